"""The cluster's shared state in Redis: node registry, sandbox bindings, locality index, reservations.

Nothing of it lives in a scheduler's memory, so any number of schedulers can serve the same
cluster and a scheduler restart loses nothing. Every change that reads before it writes runs as
one Lua script, atomic in Redis: two schedulers never both spend the same room on a node, and a
late unbind from a node the sandbox has left never removes its new binding. Times are Redis's
own clock (`TIME`), so schedulers on hosts whose clocks disagree still agree on who is down.

Key layout (prefix `aenv:`; `{node}` a node id, `{sandbox}` a sandbox id):

    aenv:nodes              SET   every registered node id
    aenv:node:{node}        HASH  info (JSON: node_id, address, version), capacity, usage,
                                  cached (JSON), status (up | draining), registered_at and
                                  heartbeat_at (Unix seconds, Redis time)
    aenv:reserved:{node}    ZSET  room promised to placements whose sandbox is not bound yet:
                                  member "{token}:{memory_mib}:{vcpus}", score its expiry
    aenv:pending:{node}     HASH  {sandbox} -> "{memory_mib}:{vcpus}": room of sandboxes that
                                  started since the node's last heartbeat (its usage lacks them)
    aenv:bindings           HASH  {sandbox} -> Binding (JSON)
    aenv:bound:{node}       SET   the sandbox ids bound to the node
    aenv:cached:{snapshot}  SET   the node ids that cache a template or snapshot (locality index)

A placement reserves its room (`reserve`); the sandbox's first running bind on that node turns
the oldest reservation into a pending entry, and the node's next heartbeat, whose usage now
counts the sandbox, clears the pending entries. A reservation whose create never binds (it
failed, its gateway died) expires after `RESERVATION_TTL`. A fork's children are placed by no
one (they start on their source's node), so their binds take the oldest reservations of
creates still under way: the room is counted once all the same, only under other names, until
the next heartbeat counts everything. A node is down when its last
heartbeat is older than `down_after`; that is computed on every read, never stored.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ..orchestrator.errors import Conflict, NotFound
from .model import Binding, NodeCapacity, NodeInfo, NodeState, NodeUsage

PREFIX = "aenv:"
# A create takes seconds (longer under TCG on a loaded host); a reservation outlives it by far,
# and one whose create failed frees its room within this long.
RESERVATION_TTL = 60.0

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"

# KEYS: nodes set, node hash. ARGV: prefix, node id, info, capacity, usage, cached.
# A (re)registration starts the node afresh: up, no reservations, no pending room; its
# locality entries are those of its new `cached` list.
_REGISTER = (
    _NOW
    + """
local old = redis.call('HGET', KEYS[2], 'cached')
if old then
  for _, id in ipairs(cjson.decode(old)) do redis.call('SREM', ARGV[1] .. 'cached:' .. id, ARGV[2]) end
end
redis.call('DEL', KEYS[2], ARGV[1] .. 'reserved:' .. ARGV[2], ARGV[1] .. 'pending:' .. ARGV[2])
redis.call('HSET', KEYS[2], 'info', ARGV[3], 'capacity', ARGV[4], 'usage', ARGV[5], 'cached', ARGV[6],
  'status', 'up', 'heartbeat_at', tostring(now), 'registered_at', tostring(now))
for _, id in ipairs(cjson.decode(ARGV[6])) do redis.call('SADD', ARGV[1] .. 'cached:' .. id, ARGV[2]) end
redis.call('SADD', KEYS[1], ARGV[2])
return 1
"""
)

# KEYS: node hash. ARGV: prefix, node id, capacity, usage, cached.
_HEARTBEAT = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('AENV_NO_NODE ' .. ARGV[2]) end
for _, id in ipairs(cjson.decode(redis.call('HGET', KEYS[1], 'cached'))) do
  redis.call('SREM', ARGV[1] .. 'cached:' .. id, ARGV[2])
end
for _, id in ipairs(cjson.decode(ARGV[5])) do redis.call('SADD', ARGV[1] .. 'cached:' .. id, ARGV[2]) end
redis.call('HSET', KEYS[1], 'capacity', ARGV[3], 'usage', ARGV[4], 'cached', ARGV[5],
  'heartbeat_at', tostring(now))
redis.call('DEL', ARGV[1] .. 'pending:' .. ARGV[2])
return 1
"""
)

# KEYS: node hash. ARGV: node id, status.
_SET_STATUS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('AENV_NO_NODE ' .. ARGV[1]) end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
return 1
"""

# KEYS: node hash, reserved zset, pending hash. ARGV: member, memory, ttl, down_after, allow_draining.
# The room test of `NodeRoom`, made again where nobody else can spend the room meanwhile.
_RESERVE = (
    _NOW
    + """
local node = redis.call('HMGET', KEYS[1], 'status', 'heartbeat_at', 'capacity', 'usage')
if not node[1] then return 0 end
if node[1] ~= 'up' and not (node[1] == 'draining' and ARGV[5] == '1') then return 0 end
if now - tonumber(node[2]) > tonumber(ARGV[4]) then return 0 end
local capacity = cjson.decode(node[3])
local taken = cjson.decode(node[4]).memory_mib + tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  taken = taken + tonumber(string.match(m, ':(%d+):%d+$'))
end
for _, v in ipairs(redis.call('HVALS', KEYS[3])) do taken = taken + tonumber(string.match(v, '^(%d+)')) end
if capacity.disk_free_mib <= 0 or taken > capacity.memory_mib then return 0 end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

# KEYS: bindings hash, node hash, bound set, reserved zset, pending hash (all of the new node).
# ARGV: prefix, sandbox id, binding, node id, state.
_BIND = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('AENV_NO_NODE ' .. ARGV[4]) end
local started = ARGV[5] == 'running'
local old = redis.call('HGET', KEYS[1], ARGV[2])
if old then
  local was = cjson.decode(old)
  if was.node_id ~= ARGV[4] then
    if not started then  -- it moves only by starting elsewhere: this is a node's late report
      return redis.error_reply('AENV_MOVED ' .. ARGV[2] .. ' ' .. was.node_id)
    end
    redis.call('SREM', ARGV[1] .. 'bound:' .. was.node_id, ARGV[2])
    redis.call('HDEL', ARGV[1] .. 'pending:' .. was.node_id, ARGV[2])
  elseif was.state == 'running' then
    started = false
  end
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[2])
if started then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  local popped = redis.call('ZPOPMIN', KEYS[4])
  if popped[1] then redis.call('HSET', KEYS[5], ARGV[2], string.match(popped[1], ':(%d+:%d+)$')) end
elseif ARGV[5] ~= 'running' then
  redis.call('HDEL', KEYS[5], ARGV[2])
end
return 1
"""
)

# KEYS: bindings hash. ARGV: prefix, sandbox id, node id.
_UNBIND = """
local old = redis.call('HGET', KEYS[1], ARGV[2])
if not old or cjson.decode(old).node_id ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[2])
redis.call('SREM', ARGV[1] .. 'bound:' .. ARGV[3], ARGV[2])
redis.call('HDEL', ARGV[1] .. 'pending:' .. ARGV[3], ARGV[2])
return 1
"""

_BINDINGS = TypeAdapter(list[Binding])


@dataclass(frozen=True)
class NodeRoom:
    """A node with what it can still take: its capacity less its usage, its reservations and
    the sandboxes started since its last heartbeat (`starting` counts those two)."""

    node: NodeInfo
    memory_mib: int
    vcpus: int
    starting: int

    def fits(self, memory_mib: int) -> bool:
        return self.node.capacity.disk_free_mib > 0 and self.memory_mib >= memory_mib


def _room(spent: list[str]) -> tuple[int, int]:
    """Memory and vCPUs of reservation members (`token:mem:vcpus`) or pending values (`mem:vcpus`)."""
    parts = [entry.rsplit(":", 2)[-2:] for entry in spent]
    return sum(int(m) for m, _ in parts), sum(int(c) for _, c in parts)


class ClusterState:
    """The cluster's records in one Redis database (see the module's key layout)."""

    def __init__(self, redis: Redis, *, down_after: float, reservation_ttl: float = RESERVATION_TTL):
        self.redis = redis
        self.down_after = down_after
        self.reservation_ttl = reservation_ttl
        self._scripts = {
            name: redis.register_script(source)
            for name, source in {
                "register": _REGISTER,
                "heartbeat": _HEARTBEAT,
                "set_status": _SET_STATUS,
                "reserve": _RESERVE,
                "bind": _BIND,
                "unbind": _UNBIND,
            }.items()
        }

    @classmethod
    def from_url(cls, url: str, *, down_after: float) -> ClusterState:
        return cls(Redis.from_url(url, decode_responses=True), down_after=down_after)

    async def close(self) -> None:
        await self.redis.aclose()

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        """Run one of the scripts; its refusals become the typed errors."""
        try:
            return await self._scripts[script](keys=keys, args=args)
        except ResponseError as exc:
            reason, *ids = str(exc).split()  # ids have no spaces (model.ID_PATTERN)
            if reason == "AENV_NO_NODE":
                raise NotFound(f"node {ids[0]} is not registered") from None
            if reason == "AENV_MOVED":
                raise Conflict(f"sandbox {ids[0]} is on node {ids[1]} now") from None
            raise

    async def now(self) -> float:
        seconds, micros = await self.redis.time()
        return seconds + micros / 1e6

    # -- nodes -----------------------------------------------------------------------------

    async def register(self, node: NodeInfo) -> NodeInfo:
        """Add the node, or start it afresh when it registers again (a restart, a lost Redis)."""
        info = node.model_dump_json(include={"node_id", "address", "version"})
        await self._run(
            "register",
            [f"{PREFIX}nodes", f"{PREFIX}node:{node.node_id}"],
            [PREFIX, node.node_id, info, node.capacity.model_dump_json(),
             node.usage.model_dump_json(), json.dumps(node.cached)],
        )  # fmt: skip
        return await self.node(node.node_id)

    async def heartbeat(
        self, node_id: str, usage: NodeUsage, capacity: NodeCapacity, cached: list[str]
    ) -> NodeInfo:
        """Record the node's liveness and load; NotFound if it is not registered."""
        await self._run(
            "heartbeat",
            [f"{PREFIX}node:{node_id}"],
            [PREFIX, node_id, capacity.model_dump_json(), usage.model_dump_json(), json.dumps(cached)],
        )
        return await self.node(node_id)

    async def set_status(self, node_id: str, status: NodeState) -> NodeInfo:
        """Up or draining (down is not a status one sets: it is a heartbeat too old)."""
        await self._run("set_status", [f"{PREFIX}node:{node_id}"], [node_id, status.value])
        return await self.node(node_id)

    async def node(self, node_id: str) -> NodeInfo:
        nodes = await self._nodes([node_id], await self.now())
        if not nodes:
            raise NotFound(f"node {node_id} is not registered")
        return nodes[0]

    async def nodes(self) -> list[NodeInfo]:
        ids = sorted(await self.redis.smembers(f"{PREFIX}nodes"))
        return await self._nodes(ids, await self.now())

    async def _nodes(self, ids: list[str], now: float) -> list[NodeInfo]:
        pipe = self.redis.pipeline(transaction=False)
        for node_id in ids:
            pipe.hgetall(f"{PREFIX}node:{node_id}")
        return [self._node(fields, now) for fields in await pipe.execute() if "info" in fields]

    def _node(self, fields: dict[str, str], now: float) -> NodeInfo:
        heartbeat_at = float(fields["heartbeat_at"])
        status = NodeState(fields["status"])
        if now - heartbeat_at > self.down_after:
            status = NodeState.DOWN
        return NodeInfo.model_validate(
            {
                **json.loads(fields["info"]),
                "capacity": json.loads(fields["capacity"]),
                "usage": json.loads(fields["usage"]),
                "cached": json.loads(fields["cached"]),
                "status": status,
                "registered_at": float(fields["registered_at"]),
                "heartbeat_at": heartbeat_at,
            }
        )

    async def rooms(self) -> list[NodeRoom]:
        """Every node with the room it has left, read in one round trip."""
        ids = sorted(await self.redis.smembers(f"{PREFIX}nodes"))
        now = await self.now()
        nodes = await self._nodes(ids, now)
        pipe = self.redis.pipeline(transaction=False)
        for node in nodes:
            pipe.zrangebyscore(f"{PREFIX}reserved:{node.node_id}", now, "+inf")
            pipe.hvals(f"{PREFIX}pending:{node.node_id}")
        spent = await pipe.execute()
        rooms = []
        for index, node in enumerate(nodes):
            entries = spent[2 * index] + spent[2 * index + 1]
            memory, vcpus = _room(entries)
            rooms.append(
                NodeRoom(
                    node=node,
                    memory_mib=node.capacity.memory_mib - node.usage.memory_mib - memory,
                    vcpus=node.capacity.vcpus - node.usage.vcpus - vcpus,
                    starting=len(entries),
                )
            )
        return rooms

    async def caching(self, snapshot_id: str) -> set[str]:
        """The ids of the nodes whose last heartbeat listed the template or snapshot as cached."""
        return set(await self.redis.smembers(f"{PREFIX}cached:{snapshot_id}"))

    # -- placement -------------------------------------------------------------------------

    async def reserve(
        self, node_id: str, memory_mib: int, vcpus: int, *, allow_draining: bool = False
    ) -> bool:
        """Promise room on the node if it is up (or draining, when allowed) and has it, atomically."""
        member = f"{secrets.token_hex(8)}:{memory_mib}:{vcpus}"
        keys = [f"{PREFIX}node:{node_id}", f"{PREFIX}reserved:{node_id}", f"{PREFIX}pending:{node_id}"]
        args = [member, memory_mib, self.reservation_ttl, self.down_after, int(allow_draining)]
        return bool(await self._run("reserve", keys, args))

    # -- bindings --------------------------------------------------------------------------

    async def bind(self, binding: Binding) -> None:
        """Record where the sandbox is; NotFound for an unregistered node, Conflict when a node
        reports as paused a sandbox bound to another node now. A sandbox moves between nodes only
        by starting on the new one (a take-over), so that node's report is late: the sandbox
        was taken over from it, and may be paused again over there."""
        node = binding.node_id
        keys = [f"{PREFIX}bindings", f"{PREFIX}node:{node}", f"{PREFIX}bound:{node}",
                f"{PREFIX}reserved:{node}", f"{PREFIX}pending:{node}"]  # fmt: skip
        args = [PREFIX, binding.sandbox_id, binding.model_dump_json(), node, binding.state]
        await self._run("bind", keys, args)

    async def unbind(self, sandbox_id: str, node_id: str) -> bool:
        """Forget the sandbox if it is bound to `node_id`; whether it was."""
        return bool(await self._run("unbind", [f"{PREFIX}bindings"], [PREFIX, sandbox_id, node_id]))

    async def binding(self, sandbox_id: str) -> Binding:
        raw = await self.redis.hget(f"{PREFIX}bindings", sandbox_id)
        if raw is None:
            raise NotFound(f"sandbox {sandbox_id} is not bound to any node")
        return Binding.model_validate_json(raw)

    async def bindings(self, node_id: str | None = None) -> list[Binding]:
        if node_id is None:
            raws = list((await self.redis.hgetall(f"{PREFIX}bindings")).values())
        else:
            ids = sorted(await self.redis.smembers(f"{PREFIX}bound:{node_id}"))
            raws = [raw for raw in (await self.redis.hmget(f"{PREFIX}bindings", ids) if ids else []) if raw]
        found = _BINDINGS.validate_json("[" + ",".join(raws) + "]")
        return sorted(found, key=lambda b: b.sandbox_id)
