"""Actor and node faults said plainly: which actor died, on which node, why, and which call it was running.

Ray reports a dead actor as `ray.exceptions.ActorDiedError` (a `RayActorError`; `ActorUnavailableError` for one it
cannot reach, e.g. on a node that is gone but not yet declared dead), which Ray Data re-raises from its executor. The
error knows the actor (its id, and for a death its class, pid, node address and Ray's cause) but not the call: a
Ray Data actor holds several calls in its queue, in any order. So every `pipeline.job.GenerateBatch` records each
call while it runs, as ``_inflight/<actor_id>-<random>.json`` in the run folder (`BatchRecorder`): the actor id,
its pid, node id and address, and the call's first and last prompt ids and size. The record is written before the
call starts and removed when it ends, whether it succeeded or raised, so a record that stays is the call of an
actor process that died mid-call. It stays as a record of that death (Ray retries the call, with
resources.max_retries > 0, under a record of its own on the restarted actor, which keeps the actor id but not the
pid), and `describe_failure` reads it to name the call: by actor id and pid for a death, by actor id and a node Ray
reports dead for an unreachable actor. Where the call cannot be known (no record: the actor died between calls or
could not write one; or an error that names no actor), the message says so rather than guess.

The record costs two small file operations per call (a write and a delete; two requests on an object store).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone

from pipeline.raydata import short_error
from runfolder.folder import INFLIGHT, RunFolder, refresh

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# On the actor: the record of the call in flight


class BatchRecorder:
    """Writes ``_inflight/<actor_id>-<random>.json`` for a call an actor is running, and removes it when the call
    ends (one file per call: an actor running calls concurrently keeps one record for each).

    Bookkeeping never fails a call: a record that cannot be written is logged once on the actor and skipped (the
    failure message then says that the call is unknown)."""

    def __init__(self, folder: RunFolder | None):
        self.folder = folder
        self.warned = False

    @classmethod
    def for_this_actor(cls, output_path: str) -> BatchRecorder:
        """The recorder of the run folder this actor's pipeline writes into. Ray Data hands its actors the driver's
        DataContext, whose checkpoint path (``<run folder>/_checkpoint``, absolute or a URL) names the folder
        wherever the actor runs; `output_path` (the config's, perhaps relative to the driver's directory) is the
        fallback when the pipeline has no checkpoint."""
        uri = None
        try:
            import ray.data

            ckpt = ray.data.DataContext.get_current().checkpoint_config
            path = getattr(ckpt, "checkpoint_path", None)
            if path and posixpath.basename(path.rstrip("/")) == "_checkpoint":
                uri = posixpath.dirname(path.rstrip("/"))
        except Exception:  # no Ray Data context here: use the config's path
            uri = None
        try:
            return cls(RunFolder(uri or output_path))
        except Exception as err:
            logger.warning("winnow: calls in flight will not be recorded (%s)", short_error(err))
            return cls(None)

    @contextlib.contextmanager
    def batch(self, prompt_ids: list[str]) -> Iterator[None]:
        path = self._write(prompt_ids)
        try:
            yield
        finally:
            if path is not None:
                self._remove(path)

    def _write(self, prompt_ids: list[str]) -> str | None:
        if self.folder is None:
            return None
        try:
            record = this_actor()
            record.update(first=prompt_ids[0] if prompt_ids else None,
                          last=prompt_ids[-1] if prompt_ids else None,
                          prompts=len(prompt_ids), started_at=datetime.now(timezone.utc).isoformat())
            name = f"{record['actor_id'] or 'pid-' + str(record['pid'])}-{uuid.uuid4().hex[:8]}.json"
            fs, folder = self.folder.fs, self.folder.join(INFLIGHT)
            path = posixpath.join(folder, name)
            data = json.dumps(record).encode()
            fs.makedirs(folder, exist_ok=True)
            if self.folder.local:  # whole or not at all: a reader never sees half a record
                tmp = posixpath.join(folder, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
                with fs.open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            else:
                fs.pipe_file(path, data)  # one PUT
            return path
        except Exception as err:
            if not self.warned:
                logger.warning("winnow: cannot record the call in flight in %s (%s); a failure of this actor "
                               "will not name its call", self.folder.uri, short_error(err))
                self.warned = True
            return None

    def _remove(self, path: str) -> None:
        try:
            self.folder.fs.rm(path)
        except Exception as err:  # a stale record only misleads if this actor later dies between calls
            logger.warning("winnow: cannot remove the call record %s (%s)", path, short_error(err))


def this_actor() -> dict:
    """The actor id, node (id and address), job id and pid of the calling process, as far as Ray knows them."""
    import ray

    out: dict = {"actor_id": None, "node_id": None, "node_ip": None, "pid": os.getpid(), "job_id": None}
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        out["actor_id"] = ctx.get_actor_id()
        out["node_id"] = ctx.get_node_id()
        out["job_id"] = ctx.get_job_id()
        with contextlib.suppress(Exception):
            out["node_ip"] = ray.util.get_node_ip_address()
    return out


# ---------------------------------------------------------------------------------------------------------------
# On the driver: the failure, said plainly


def inflight_records(folder: RunFolder) -> list[dict]:
    """The call records left in `folder`'s ``_inflight/`` (unreadable ones skipped), oldest first."""
    base = folder.join(INFLIGHT)
    refresh(folder.fs, base)
    try:
        names = folder.fs.ls(base, detail=False) if folder.fs.isdir(base) else []
    except OSError:
        return []
    out = []
    for p in sorted(names):
        if not p.endswith(".json") or posixpath.basename(p).startswith("."):
            continue
        try:
            with folder.fs.open(p, "rb") as f:
                record = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict):
            out.append(record)
    return sorted(out, key=lambda r: str(r.get("started_at")))


def actor_error(err: BaseException):
    """The first `ray.exceptions.RayActorError` in `err`'s chain (causes, contexts, a RayTaskError's cause), or
    None. Ray Data raises the actor's error itself, from a bare `ray.data.exceptions.SystemException`."""
    from ray.exceptions import RayActorError

    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RayActorError):
            return e
        cause = getattr(e, "cause", None)  # ray.exceptions.RayTaskError keeps the remote exception here
        todo += [e.__cause__, e.__context__, cause if isinstance(cause, BaseException) else None]
    return None


_FIELD = re.compile(r"^\s*(class_name|actor_id|pid|ip|name|namespace): (\S.*?)\s*$", re.MULTILINE)


def death_cause(text: str) -> str:
    """Ray's reason for an actor's death from its error text, without Ray's list of common causes."""
    because = re.search(r"The actor is dead because (.*?)\.(?:\s|$)", text)
    kind = re.search(r"Worker exit type: (\S+)", text)
    detail = re.search(r"Worker exit detail: (.*?)(?:\s+Some common causes|\n|$)", text, re.DOTALL)
    parts = [because.group(1)] if because else []
    if kind:
        parts.append(f"exit type {kind.group(1)}" + (f": {detail.group(1).rstrip('.')}" if detail else ""))
    if not parts:  # not a death Ray explained: its first line after the fields
        rest = [ln.strip() for ln in text.splitlines() if ln.strip() and not _FIELD.match(ln)]
        parts = rest[1:2] or rest[:1]
    return "; ".join(parts) or "cause not reported"


def dead_node_ids() -> set[str]:
    """Nodes of the connected Ray cluster that Ray reports dead (empty when that cannot be asked)."""
    try:
        import ray

        return {n["NodeID"] for n in ray.nodes() if not n.get("Alive")} if ray.is_initialized() else set()
    except Exception:
        return set()


def plural(n, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def describe_failure(err: BaseException, folder: RunFolder | None = None, dead_nodes: set[str] | None = None) -> str:
    """One line for a failed run. A dead or unreachable actor is named with its class (when Ray says) and pid, its
    node (address and id), Ray's cause of death, and the call it was running when the run folder holds that call's
    record (`BatchRecorder`); otherwise the line says the call cannot be named. Any other error is
    `pipeline.raydata.short_error`, as before. `dead_nodes` (default: asked of Ray) picks, for an unreachable actor
    that Ray restarted elsewhere, the record of the process on the lost node."""
    from ray.exceptions import ActorUnavailableError

    dead = actor_error(err)
    if dead is None:
        return short_error(err)
    text = str(dead)
    fields = dict(_FIELD.findall(text))
    actor_id = getattr(dead, "actor_id", None) or fields.get("actor_id")
    unreachable = isinstance(dead, ActorUnavailableError)
    records: list[dict] = []
    if folder is not None and actor_id:
        try:
            records = [r for r in inflight_records(folder) if r.get("actor_id") == actor_id]
        except Exception:  # the run folder cannot be read now: the call is unknown, the actor is still named
            records = []
    if fields.get("pid"):  # a death: the records of that very process
        records = [r for r in records if str(r.get("pid")) == fields["pid"]]
    elif len({r.get("pid") for r in records}) > 1:  # several lives of the actor: the one on a lost node
        lost = dead_node_ids() if dead_nodes is None else dead_nodes
        records = [r for r in records if r.get("node_id") in lost] or records
    rec = records[-1] if records else {}
    pid = fields.get("pid") or (rec.get("pid") if len({r.get("pid") for r in records}) == 1 else None)
    what = ", ".join(x for x in (fields.get("class_name"), f"pid {pid}" if pid else None) if x)
    who = f"actor {actor_id or '(id not reported)'}" + (f" ({what})" if what else "")
    ip, node_id = fields.get("ip") or rec.get("node_ip"), rec.get("node_id")
    where = ("on node " + " ".join(x for x in (ip, f"(node id {node_id})" if node_id else None) if x)
             if ip or node_id else "on a node Ray did not report")
    if getattr(dead, "actor_init_failed", False):
        return f"{who} {where} failed while starting, before running any call: {short_error(dead)}"
    if unreachable:
        how = f"became unreachable ({text.split('is unavailable: ', 1)[-1].split('. The task may', 1)[0]})"
    else:
        how = f"died ({death_cause(text)})"
    if records:
        calls = "; ".join(f"{r.get('first')}..{r.get('last')} ({plural(r.get('prompts'), 'prompt')}"
                            + (f", pid {r.get('pid')}" if not pid else "") + ")" for r in records)
        call = f"while running the call{'s' if len(records) > 1 else ''} of prompts {calls}"
    elif folder is None:
        call = "while running a call that cannot be named (no run folder to read its record from)"
    else:
        call = (f"while running a call that cannot be named: {INFLIGHT}/ in the run folder holds no record of "
                "one (the actor died between calls, or could not write the record)")
    return f"{who} {where} {how} {call}"
