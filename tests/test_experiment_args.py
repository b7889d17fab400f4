"""experiments/_options.parse: the one parser of `--experiment=NAME:ARG`, and every experiment
refusing an ARG it would otherwise ignore."""

import importlib
import pkgutil

import pytest

import experiments
from experiments import _options

DEFAULTS = {"name": "a", "count": 2, "rate": 0.5, "flag": False}


def test_typed_pairs_positional_and_flags():
  got = _options.parse("b,count=3,rate=1,flag", DEFAULTS, positional=("name",))
  assert got == {"name": "b", "count": 3, "rate": 1.0, "flag": True}
  assert isinstance(got["rate"], float)
  assert _options.parse(None, DEFAULTS) == DEFAULTS
  assert _options.parse("", DEFAULTS) == DEFAULTS
  assert _options.parse("flag=false,name='x,y'", DEFAULTS)["name"] == "x,y"
  # rest: keys without a default kept as text for a backend's own parser
  assert _options.parse("count=1,kernel=prefix", DEFAULTS, rest=True)["kernel"] == "prefix"


@pytest.mark.parametrize(
  "arg,match",
  [
    ("size=3", r"x:size=3: unknown option 'size'; available: name='a', count=2, rate=0.5"),
    ("count=three", r"count='three' is not int"),
    ("rate=fast", r"rate='fast' is not float"),
    ("flag=maybe", r"flag='maybe' is not a bool"),
    ("count=1,=2", r"malformed item '=2'"),
    ("name=(a", r"unbalanced quotes or brackets"),
    ("bare", r"unknown option 'bare'"),
    ("name=c", r"unknown name 'c'; available: a, b"),
  ],
)
def test_errors_name_the_item_and_what_is_valid(arg, match):
  with pytest.raises(ValueError, match=match):
    _options.parse(arg, DEFAULTS, {"name": ("a", "b")}, name="x")


def _experiments():
  return [m.name for m in pkgutil.iter_modules(experiments.__path__) if not m.name.startswith("_")]


@pytest.mark.parametrize("name", _experiments())
def test_every_experiment_refuses_an_unknown_option(name, capsys):
  """Named by the parser, or (options passed to a backend) by the backend, at get_config."""
  module = importlib.import_module(f"experiments.{name}")
  with pytest.raises(ValueError, match="no_such_option"):
    module.get_config("no_such_option=1")
