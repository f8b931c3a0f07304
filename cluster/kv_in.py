"""A decode worker's side of the KV wire: each request's transfer, from its begin to its import.

The import begins when the transfer begins, blocks allowing; otherwise its parts wait, in arrival
order (first come, first served: no overtaking), until blocks free up. Each part is copied into the
request's blocks as it lands and its receive buffer released; the end brings the first token, and
the request joins the running decodes. Any failure ends that request's import alone, its blocks
freed, with an `import_failed` event. Used by the worker's loop thread only.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from cluster.events import Imported, ImportFailed, WorkerEvent
from cluster.transfer.base import Begin, Cancel, Delivery, End, Part, checked
from cluster.transfer.staging import fence_import
from cluster.transfer.wire import KVHandoff, WireError
from workers.engine import Engine
from workers.request import InvalidRequest


class RecentIds:
    """The last `limit` ids added, for membership tests: what a long-running worker remembers of
    the requests it aborted (so their late KV is dropped on arrival) without growing forever."""

    def __init__(self, limit: int):
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        self._ids.move_to_end(rid)
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __contains__(self, rid) -> bool:
        return rid in self._ids

    def __len__(self) -> int:
        return len(self._ids)


def reason_of(e: Exception) -> str:
    return e.reason if isinstance(e, InvalidRequest) else f"{type(e).__name__}: {e}"


@dataclass
class Incoming:
    """A request's KV arriving here: its import begun once blocks allowed, parts waiting till then."""

    handoff: KVHandoff
    began: bool = False
    staged: list[Part] = field(default_factory=list)
    end: End | None = None



class KVIn:
    def __init__(self, engine: Engine, emit: Callable[[WorkerEvent], None]):
        self.engine = engine
        self.emit = emit
        self.incoming: dict[str, Incoming] = {}      # arrival order

    @property
    def waiting(self) -> bool:
        """Some transfer waits for blocks: the loop should keep trying."""
        return any(not i.began for i in self.incoming.values())

    def receive(self, d: Delivery, aborted) -> None:
        rid = d.handoff.request_id if isinstance(d, Begin) else d.request_id
        inc = self.incoming.get(rid)
        try:   # what the wires deliver has passed their decoder; a delivery made any other way is held to it too
            checked(d)
        except WireError as e:
            if isinstance(d, Part):
                d.release()
            if self.end(rid) or isinstance(d, Begin):
                self.emit(ImportFailed(rid, str(e)))
            return
        if isinstance(d, Begin):
            if rid in aborted:
                return
            try:   # refused at once if it could never be imported here: waiting would block those behind it
                self.engine.validate(rid, d.handoff.prompt_ids, d.handoff.params)
            except Exception as e:
                self.emit(ImportFailed(rid, reason_of(e)))
                return
            self.incoming[rid] = Incoming(d.handoff)
        elif isinstance(d, Part):
            if inc is None:                     # refused, aborted or dropped: its parts just go
                d.release()
            elif inc.began:
                self._import_part(rid, d)
            else:
                inc.staged.append(d)
        elif isinstance(d, End):
            if inc is not None:
                inc.end = d
                if inc.began:
                    self._finish_import(rid)
        elif isinstance(d, Cancel):
            self.end(rid)             # the sender gave up; it will retry or has told the router

    def admit(self) -> None:
        """Begin imports in arrival order while blocks allow; a waiting one keeps its parts."""
        for rid, inc in list(self.incoming.items()):
            if inc.began:
                continue
            if not self.engine.can_import(len(inc.handoff.prompt_ids)):
                return                           # first come, first served: no overtaking
            h = inc.handoff
            try:
                self.engine.begin_import(rid, h.prompt_ids, h.params)
            except Exception as e:
                self.end(rid)
                self.emit(ImportFailed(rid, reason_of(e)))
                continue
            inc.began = True
            staged, inc.staged = inc.staged, []
            for part in staged:
                if not self._import_part(rid, part):
                    for rest in staged:
                        rest.release()
                    break
            if rid in self.incoming and inc.end is not None:
                self._finish_import(rid)

    def _import_part(self, rid: str, part: Part) -> bool:
        try:
            fence_import(part.kv, part.ready)     # CUDA: after the copy that filled it; memory kept till read
            self.engine.import_kv(rid, part.first_layer, part.kv, part.start)
            return True
        except Exception as e:   # refused, or failed while copying in: its blocks are freed
            self.end(rid)
            self.emit(ImportFailed(rid, reason_of(e)))
            return False
        finally:
            part.release()                        # copied into the pool, or refused: done with it

    def _finish_import(self, rid: str) -> None:
        end = self.incoming.pop(rid).end
        try:
            self.engine.finish_import(rid, end.first_token)
        except Exception as e:
            self.engine.abort(rid, "import failed")
            self.emit(ImportFailed(rid, reason_of(e)))
            return
        self.emit(Imported(rid, end.nbytes, end.recv_s, arrived=end.arrived, time=time.time(),
                           prefill_end=end.first_token_time))

    def end(self, rid: str) -> bool:
        """Forget a transfer here: its import (if begun) aborted, its waiting parts released."""
        inc = self.incoming.pop(rid, None)
        if inc is None:
            return False
        for part in inc.staged:
            part.release()
        if inc.began:
            self.engine.abort(rid, "transfer ended")
        return True
