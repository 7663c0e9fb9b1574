"""Every exercise checker answers, never raises: None says "not answered", a wrong answer gets a falsy
Verdict with a message. (The right answers are checked where the notebooks' solution cells run them.)"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import flashref.exercises as exercises
from flashref.exercises import NOT_ANSWERED, Verdict

MODULES = [importlib.import_module(f"flashref.exercises.{m.name}") for m in pkgutil.iter_modules(exercises.__path__)]
CHECKERS = [(f"{mod.__name__.rsplit('.', 1)[1]}.{name}", fn) for mod in MODULES
            for name, fn in inspect.getmembers(mod, inspect.isfunction)
            if name.startswith("check_") and fn.__module__ == mod.__name__]


def test_every_notebook_topic_has_checkers():
    assert len(MODULES) >= 7 and len(CHECKERS) >= 14


@pytest.mark.parametrize("name,check", CHECKERS, ids=[n for n, _ in CHECKERS])
def test_unanswered_is_not_correct(name, check):
    verdict = check(None)
    assert isinstance(verdict, Verdict) and not verdict
    assert repr(verdict) == NOT_ANSWERED


@pytest.mark.parametrize("wrong_answer", [-12345.678, "not a number"])
@pytest.mark.parametrize("name,check", CHECKERS, ids=[n for n, _ in CHECKERS])
def test_wrong_answer_gets_a_message(name, check, wrong_answer):
    verdict = check(wrong_answer)
    assert isinstance(verdict, Verdict) and not verdict
    assert repr(verdict).startswith("Not quite")
