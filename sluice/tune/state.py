"""The run's state file: one JSON line per measured candidate, so that a run interrupted
(Ctrl-C, a lost machine) resumes where it was. Lines are keyed by the settings that make
measurements comparable; a rerun with other settings measures everything again."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any

import orjson

from sluice.tune.candidates import Candidate
from sluice.tune.search import Level, Objective, Outcome, worse


def fingerprint(comparable: dict[str, Any]) -> str:
    """A short digest of what must match for an earlier measurement to count."""
    return hashlib.sha256(orjson.dumps(comparable, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def load(path: Path, key: str, objective: Objective) -> dict[Candidate, Outcome]:
    """The outcomes an earlier run with the same key recorded, a candidate measured twice as
    its worse measurement (a torn last line is skipped)."""
    outcomes: dict[Candidate, Outcome] = {}
    if not path.is_file():
        return outcomes
    for line in path.read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if record.get("key") != key:
            continue
        levels = tuple(_level(level) for level in record["levels"])
        candidate = Candidate(**record["candidate"])
        outcome = Outcome(levels, record["seconds"])
        if candidate in outcomes:
            outcome = worse(outcomes[candidate], outcome, objective)
        outcomes[candidate] = outcome
    return outcomes


def append(path: Path, key: str, candidate: Candidate, outcome: Outcome) -> None:
    """Record one outcome, flushed line by line so an interruption loses at most the
    candidate being measured."""
    record = {
        "key": key,
        "candidate": dataclasses.asdict(candidate),
        "levels": [dataclasses.asdict(level) for level in outcome.levels],
        "seconds": outcome.seconds,
    }
    with path.open("a+b") as file:
        torn = file.tell() > 0 and file.seek(-1, 2) >= 0 and file.read(1) != b"\n"
        file.write((b"\n" if torn else b"") + orjson.dumps(record) + b"\n")


def _level(record: dict[str, Any]) -> Level:
    """JSON has no infinity: a level with no answer wrote its p99 as null."""
    p99_ms = record["p99_ms"]
    return Level(**{**record, "p99_ms": math.inf if p99_ms is None else p99_ms})
