"""The controller's read of the node heartbeats: every live node's key in one request,
and of what comes back only what is new since the last read (a launcher beats every
interval; the controller polls every half interval, and a value read twice is one beat)."""

from __future__ import annotations

import logging

from odyssey_megatron.runtime.protocol.auth import SignedStore
from odyssey_megatron.runtime.protocol.keys import DOORBELL
from odyssey_megatron.runtime.protocol.messages import NodeHeartbeat, ProtocolError

__all__ = ["HeartbeatReader"]

log = logging.getLogger(__name__)


class HeartbeatReader:
    def __init__(self) -> None:
        self._seen: dict[str, bytes] = {}
        """Heartbeat key -> the node heartbeat last parsed under it."""

    def read(self, store: SignedStore, keys: list[str]) -> dict[str, NodeHeartbeat]:
        """The heartbeats under ``keys`` that are new since the last read, in one request."""
        unseen = [key for key in keys if key not in self._seen]
        if unseen and not store.check(unseen):  # a sender that broke protocol (or a forger): multi_get would wait
            keys = [key for key in keys if key in self._seen or store.check([key])]
        beats = {}
        for key, raw in zip(keys, store.multi_get(keys) if keys else []):
            if raw is None or raw == DOORBELL or raw == self._seen.get(key):
                continue  # forged (refused, logged), rung since its last beat, or no beat since the last read
            self._seen[key] = raw
            try:
                beats[key] = NodeHeartbeat.from_json(raw)
            except ProtocolError as exc:
                log.warning("controller: malformed heartbeat under %s: %s", key, exc)
        return beats
