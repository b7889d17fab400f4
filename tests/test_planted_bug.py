"""The contract's exactness tests can fail: a one-ulp bug planted in each backend's sparse
update (offload's rows, hot_cold's cold and hot rows, sharded's rows) fails them, in them
only, and the clean run passes (tests/planted_bug.py). `long`: each target runs the
contract's selection twice in fresh processes (~25 s to minutes)."""

import pytest

from tests import planted_bug


@pytest.mark.long
@pytest.mark.parametrize("target", sorted(planted_bug.TARGETS))
def test_a_planted_one_ulp_bug_fails_the_exactness_tests(target):
  ok, said = planted_bug.check(target)
  assert ok, said


def test_a_run_failing_outside_the_exactness_tests_is_not_caught():
  """The verdict reads which tests failed and how: an error (an import of the plant, a
  fixture), a failure elsewhere or one raising something else is not the bug caught."""
  exact = planted_bug.EXACTNESS + "sgd-offload-1x1]"
  assertion = {"AssertionError"}

  def caught(failed, errors=(), raised=assertion, returncode=1) -> bool:
    outcome = planted_bug.Outcome(returncode, [], list(failed), list(errors), set(raised), "")
    return outcome.failed_in_exactness()

  assert caught([exact])
  assert not caught([])
  assert not caught([exact], errors=["tests/test_contract.py"])
  assert not caught(["tests/test_contract.py::test_other[x]"])
  assert not caught([exact], raised={"AssertionError", "ImportError"})
  assert not caught([exact], raised=set())
  assert not caught([exact], returncode=0)
