"""Self-SD search's study journal: where it lies, its locks, and its lines checked before optuna replays them.

The study of ``layerskip search`` is an optuna journal (``plans/x.study.log`` beside ``plans/x.json``): one JSON
object a line, each an operation optuna replays in order to rebuild the study. A line cannot be skipped (the lines
after it number their trials and refer to its trial ids), so a damaged journal is refused in one line naming the
file and the line, before optuna reads it (optuna would stop on an ``AssertionError`` or a ``KeyError``); ``--force``
starts the search over. A search holds the locks of its plan file and journal while it runs (``holding_search``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

from layerskip_core.errors import UserError
from layerskip_core.locks import holding

OPERATIONS = {0: ("study_name", "directions"), 1: ("study_id",), 2: ("study_id", "user_attr"),
              3: ("study_id", "system_attr"), 4: ("study_id", "datetime_start"),
              5: ("trial_id", "param_name", "param_value_internal", "distribution"),
              6: ("trial_id", "state", "values"), 7: ("trial_id", "step", "intermediate_value"),
              8: ("trial_id", "user_attr"), 9: ("trial_id", "system_attr"), 10: ()}
"""The journal's operations (optuna 5's ``JournalOperation`` codes) and the fields each must carry."""
ONE_ATTR = ("user_attr", "system_attr")
"""Fields that hold exactly one attribute (a one-key object) in every operation that has them."""


def study_path_for(out: Path) -> Path:
    """The optuna journal beside the plan: plans/x.json -> plans/x.study.log."""
    return out.with_name(out.stem + ".study.log")


def lock_path_for(path: Path) -> Path:
    """The lock a search holds on one of its outputs: plans/x.json -> plans/.x.json.layerskip-search.lock."""
    return path.with_name(f".{path.name}.layerskip-search.lock")


@contextlib.contextmanager
def holding_search(out: Path, study_path: Path | None) -> Iterator[None]:
    """Hold the locks of the plan file ``out`` and of the study journal (``layerskip_core.locks``) for the ``with``
    block: a second search into either meanwhile is refused in one line naming the holder, instead of deleting the
    journal under the first (``--force``) or mixing its trials into it. A holder that died leaves nothing blocking."""
    paths = [Path(out).expanduser()] + ([Path(study_path).expanduser()] if study_path is not None else [])
    created = sorted({d for p in paths for d in p.parents if not d.exists()}, key=lambda d: -len(d.parts))
    try:
        with contextlib.ExitStack() as stack:
            for path in paths:
                path.parent.mkdir(parents=True, exist_ok=True)
                stack.enter_context(holding(lock_path_for(path), lambda holder, path=path: (
                    f"{path} is in use by another search ({holder}); wait for it to end or choose another --out")))
            yield
    finally:
        for folder in created:  # a search refused before it wrote anything leaves no empty folder behind
            with contextlib.suppress(OSError):
                folder.rmdir()


def open_study(storage_path: Path | None, settings: dict, fresh: bool = False):
    """Create or resume the study stored in a journal file (None: in memory)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = None
    if storage_path is not None:
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        storage_path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and storage_path.exists():
            storage_path.unlink()
        _remove_stale_lock(storage_path)
        check_journal(storage_path)
    try:
        if storage_path is not None:
            storage = JournalStorage(JournalFileBackend(str(storage_path)))
        study = optuna.create_study(storage=storage, study_name="self_sd", direction="maximize", load_if_exists=True)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, AssertionError) as e:  # a line that passed
        raise UserError(f"the study journal {storage_path} is damaged ({type(e).__name__}); pass --force to "
                        "start the search over") from None
    stored = study.user_attrs.get("settings")
    if stored is None:
        study.set_user_attr("settings", settings)
    elif stored != settings:
        diff = ", ".join(f"{k}: {stored.get(k)!r} -> {settings.get(k)!r}" for k in sorted(set(stored) | set(settings))
                         if stored.get(k) != settings.get(k))
        raise UserError(f"the study in {storage_path} was run with other settings ({diff}); pass --force to "
                        "start over or choose another --out")
    return study


def check_journal(journal: Path) -> None:
    """Refuse a journal cut short (no final newline) or holding a line that is not one of optuna's operations (not
    JSON, not an object, an unknown operation, a field missing), in one line naming the file and the line."""
    try:
        data = journal.read_bytes() if journal.exists() else b""
    except OSError as e:
        raise UserError(f"the study journal {journal} cannot be read ({e.strerror or e}); pass --force to start the "
                        "search over") from None
    lines = data.splitlines()
    problem = "it is cut short (no newline after its last line)" if data and not data.endswith(b"\n") else None
    for number, line in enumerate(lines if problem is None else (), 1):
        if line.strip() and (why := _operation_problem(line)) is not None:
            problem = f"line {number} {why}"
            break
    if problem is not None:
        raise UserError(f"the study journal {journal} is damaged: {problem}; pass --force to start the search over")


def _operation_problem(line: bytes) -> str | None:
    """Why one journal line is not an operation optuna can replay, or None."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return "is not JSON"
    if not isinstance(entry, dict):
        return "is not a JSON object"
    op = entry.get("op_code")
    if isinstance(op, bool) or not isinstance(op, int) or op not in OPERATIONS:
        return f"has no known operation (op_code {op!r})"
    missing = [key for key in ("worker_id", *OPERATIONS[op]) if key not in entry]
    if missing:
        return f"lacks {', '.join(missing)} (op_code {op})"
    if any(key in entry and not (isinstance(entry[key], dict) and len(entry[key]) == 1) for key in ONE_ATTR):
        return f"holds an attribute that is not one key and value (op_code {op})"
    return None


def _remove_stale_lock(journal: Path, stale_after: float = 2.0) -> None:
    """Remove the journal's lock left by a killed search (optuna would wait 30 s for it).

    The lock is held only while one log line is written (milliseconds), so one older than a couple
    of seconds belongs to a process that is gone.
    """
    lock = journal.with_name(journal.name + ".lock")
    try:
        age = time.time() - lock.lstat().st_mtime
    except OSError:
        return
    if age > stale_after:
        with contextlib.suppress(OSError):
            lock.unlink()
