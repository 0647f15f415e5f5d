"""The CLI prints one line for an error the user can fix (exit 2) and lets a bug show its traceback."""

from __future__ import annotations

import pytest

from wafer_gpt2.cli import main as cli
from wafer_gpt2.cli import plan_command
from wafer_gpt2.core.steps import BackendError
from wafer_gpt2.engine.failures import ServiceError
from wafer_gpt2.errors import InvalidInput, WaferGPT2Error
from wafer_gpt2.plan.structure import PlanError


def run_raising(monkeypatch, error: BaseException) -> int:
    def run(args):
        raise error

    monkeypatch.setattr(plan_command, "run", run)  # `register` picks it up when main builds the parser
    return cli.main(["plan"])


@pytest.mark.parametrize(
    "error",
    [cli.UserError("bad flag"), PlanError("no room"), InvalidInput("bad shape"), FileNotFoundError("gone")],
)
def test_user_errors_print_one_line(monkeypatch, capsys, error):
    assert run_raising(monkeypatch, error) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("wafer-gpt2 plan: error: ")


def test_a_bug_is_not_swallowed(monkeypatch):
    with pytest.raises(KeyError):
        run_raising(monkeypatch, KeyError("a bug"))
    with pytest.raises(ValueError):  # a plain ValueError is not a user error any more
        run_raising(monkeypatch, ValueError("a bug"))


def test_the_error_bases_share_one_root():
    for base in (cli.UserError, ServiceError, BackendError, PlanError, InvalidInput):
        assert issubclass(base, WaferGPT2Error)
    assert issubclass(BackendError, RuntimeError) and issubclass(PlanError, ValueError)  # old catches hold
