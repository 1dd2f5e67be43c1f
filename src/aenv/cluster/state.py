"""The cluster's shared state in Redis: node registry, sandbox bindings, locality index, reservations.

It stays one module over 600 lines: the key layout below and the Lua scripts that keep it are one
contract, and each script reads keys that the others write.

Nothing of it lives in a scheduler's memory, so any number of schedulers can serve the same
cluster and a scheduler restart loses nothing. Every change that reads before it writes runs as
one Lua script, atomic in Redis: two schedulers never both spend the same room on a node, and a
late unbind from a node the sandbox has left never removes its new binding, nor a late bind (of
an older generation of the sandbox on its node) a newer one. Times are Redis's own clock
(`TIME`), so schedulers on hosts whose clocks disagree still agree on who is down.

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
    aenv:placing            HASH  {sandbox} -> "{node} {expiry} {member}": a create placed with
                                  its binding whose node has not bound the sandbox yet
    aenv:cached:{snapshot}  SET   the node ids that cache a template or snapshot (locality index)
    aenv:tombstone:{sandbox} STRING the node the sandbox was bound to when it was killed while
                                  that node could not be reached; expires after `tombstone_ttl`

A placement chooses its node and reserves its room in one script (`place`); the sandbox's first
running bind on that node turns the reservation into a pending entry, and the node's next
heartbeat, whose usage now counts the sandbox, clears the pending entries. A reservation whose
create never binds (it failed, its gateway died) expires after `RESERVATION_TTL`; a resume's
(a take-over) is named by its sandbox, so that one a node refused is released at once.

A create's placement names the sandbox (the gateway chose its id) and records its binding in the
same script, so the gateway's create is one scheduler call and the sandbox is locatable from the
moment the node answers. Until the node binds it itself the binding is `placing`; a create that
fails is unbound by its gateway, which frees its reservation too. The node's reconciliation does
not see a placing binding (`bindings(node)`: the node holds no such sandbox until its create
ends) until the reservation expired, which is a gateway that died mid-create: then the node
drops it, if it holds no such sandbox. A fork's children are placed by no
one (they start on their source's node), so their binds take the oldest reservations of
creates still under way: the room is counted once all the same, only under other names, until
the next heartbeat counts everything. A node is down when its last
heartbeat is older than `down_after`; that is computed on every read, never stored.

A sandbox killed while its node is down cannot be killed on the node: the kill (`tombstone`)
removes its binding and writes its tombstone in one script, and every later bind of it is
refused (`SandboxKilled`), whichever node sends it. So the node, when it is back, learns from
its own report that the sandbox was killed, and kills it (`aenv.cluster.membership`); a late
report of a take-over that raced the kill cannot bind it again either. The kill returns the
binding it removed: a durable pause in it is deleted from the shared repository by a live node
at once (`ClusterNode.kill`), without waiting for a node that may never come back.

A tombstone is kept for `tombstone_ttl` (a setting, 30 days by default), also after its node
killed the sandbox, rather than until the node acknowledges it: a node that never comes back
would keep its tombstones forever, and an acknowledgement would let another node's late report
through. A node away for longer than that would bind again what was killed meanwhile, so the
setting is to be longer than any outage a node comes back from with its disk.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import ResponseError

from ..config import Settings
from ..orchestrator.errors import Conflict, NotFound
from .model import Binding, NodeCapacity, NodeInfo, NodeState, NodeUsage, Placement
from .protocols import SandboxKilled

PREFIX = "aenv:"
# A create takes seconds (longer under TCG on a loaded host); a reservation outlives it by far,
# and one whose create failed frees its room within this long.
RESERVATION_TTL = 60.0
# A placement weighs the sandbox's home node (a resume), up to this many random nodes caching the
# template and as many random nodes, and all nodes only when none of those has room: reading every
# node made a placement cost Redis 0.5 ms at 50 nodes and 11 ms at 1,000 (so at most ~90
# placements/s, Redis being single-threaded), against ~0.3 ms whatever the count with a sample.
# With this many nodes or fewer, every node is weighed, as before.
PLACE_SAMPLE = 16
# redis-py's pool refuses a command once 100 are in flight ("Too many connections": a scheduler
# serving 1,000 nodes' heartbeats and 64 creates at once hit it); a blocking pool makes it wait
# instead. Redis runs one command at a time, so more connections would add no throughput.
REDIS_CONNECTIONS = 64
REDIS_WAIT = 5.0

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

# KEYS: bindings hash, node hash, bound set, reserved zset, pending hash (all of the new node),
# placing hash. ARGV: prefix, sandbox id, binding, node id, state, observed ('1' or '0'),
# generation. A killed sandbox (its tombstone) is never bound again. A bind older than the
# binding the node has already (a lower generation of the sandbox on that node) is late, and
# changes nothing; so does an observed bind (a gateway's, see `Scheduler.bind`) of the state the
# sandbox has on that node already. A sandbox's first running bind on a node spends its own
# placement's reservation, else the oldest one (a fork's child, or a create placed without a
# name).
_BIND = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('AENV_NO_NODE ' .. ARGV[4]) end
if redis.call('EXISTS', ARGV[1] .. 'tombstone:' .. ARGV[2]) == 1 then
  return redis.error_reply('AENV_KILLED ' .. ARGV[2])
end
local old = redis.call('HGET', KEYS[1], ARGV[2])
local was = old and cjson.decode(old)
if was and was.node_id == ARGV[4] then
  if (was.generation or 0) > tonumber(ARGV[7]) then return 0 end
  if ARGV[6] == '1' and was.state == ARGV[5] then return 0 end
end
local started = ARGV[5] == 'running'
local placed = redis.call('HGET', KEYS[6], ARGV[2])
if placed and started then redis.call('HDEL', KEYS[6], ARGV[2]) end
if was then
  if was.node_id ~= ARGV[4] then
    if not started then  -- it moves only by starting elsewhere: this is a node's late report
      return redis.error_reply('AENV_MOVED ' .. ARGV[2] .. ' ' .. was.node_id)
    end
    redis.call('SREM', ARGV[1] .. 'bound:' .. was.node_id, ARGV[2])
    redis.call('HDEL', ARGV[1] .. 'pending:' .. was.node_id, ARGV[2])
  elseif was.state == 'running' and not placed then
    started = false
  end
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[2])
if started then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  local member = nil
  if placed then
    local node, _, mine = string.match(placed, '^(%S+) (%S+) (%S+)$')
    if node == ARGV[4] and redis.call('ZREM', KEYS[4], mine) == 1 then member = mine end
  end
  if not member then member = redis.call('ZPOPMIN', KEYS[4])[1] end
  if member then redis.call('HSET', KEYS[5], ARGV[2], string.match(member, ':(%d+:%d+)$')) end
elseif ARGV[5] ~= 'running' then
  redis.call('HDEL', KEYS[5], ARGV[2])
end
return 1
"""
)

# Forget the binding `old` (JSON) of a sandbox. A binding still placing is a create that failed
# (or whose sandbox is gone already): its reservation goes with it.
_FORGET = """
local function forget(prefix, bindings, placing, sandbox, old)
  local node = cjson.decode(old).node_id
  local placed = redis.call('HGET', placing, sandbox)
  if placed then
    local at, _, member = string.match(placed, '^(%S+) (%S+) (%S+)$')
    redis.call('HDEL', placing, sandbox)
    redis.call('ZREM', prefix .. 'reserved:' .. at, member)
  end
  redis.call('HDEL', bindings, sandbox)
  redis.call('SREM', prefix .. 'bound:' .. node, sandbox)
  redis.call('HDEL', prefix .. 'pending:' .. node, sandbox)
end
"""

# KEYS: bindings hash, placing hash. ARGV: prefix, sandbox id, node id.
_UNBIND = (
    _FORGET
    + """
local old = redis.call('HGET', KEYS[1], ARGV[2])
if not old or cjson.decode(old).node_id ~= ARGV[3] then return 0 end
forget(ARGV[1], KEYS[1], KEYS[2], ARGV[2], old)
return 1
"""
)

# KEYS: bindings hash, placing hash. ARGV: prefix, sandbox id, node id, tombstone ttl (ms).
# The kill of a sandbox whose node cannot be reached: unbound, and tombstoned, only if it is
# still bound to that node (else it moved, and is killed where it went). Returns its binding.
_TOMBSTONE = (
    _FORGET
    + """
local old = redis.call('HGET', KEYS[1], ARGV[2])
if not old then return redis.error_reply('AENV_UNBOUND ' .. ARGV[2]) end
local node = cjson.decode(old).node_id
if node ~= ARGV[3] then return redis.error_reply('AENV_MOVED ' .. ARGV[2] .. ' ' .. node) end
forget(ARGV[1], KEYS[1], KEYS[2], ARGV[2], old)
redis.call('SET', ARGV[1] .. 'tombstone:' .. ARGV[2], node, 'PX', ARGV[4])
return old
"""
)

# A node as the reads below return it: id, hash fields (flat), live reservations, pending room.
# `node_record` is the first two alone, for reads that want the node, not its room: a placement's
# answer and a locate. With them, every placement's answer carried the node's every live
# reservation (thousands under load), and decoding those was half of the scheduler's CPU.
_NODE_ENTRY = """
local function node_record(prefix, id)
  return {id, redis.call('HGETALL', prefix .. 'node:' .. id)}
end
local function node_entry(prefix, id, now)
  local entry = node_record(prefix, id)
  entry[3] = redis.call('ZRANGEBYSCORE', prefix .. 'reserved:' .. id, now, '+inf')
  entry[4] = redis.call('HVALS', prefix .. 'pending:' .. id)
  return entry
end
"""

# KEYS: nodes set. ARGV: prefix, node ids (none: every registered node). Read in one round trip.
_ROOMS = (
    _NOW
    + _NODE_ENTRY
    + """
local ids = redis.call('SMEMBERS', KEYS[1])
if #ARGV > 1 then ids = {unpack(ARGV, 2)} end
local out = {tostring(now)}
for _, id in ipairs(ids) do out[#out + 1] = node_entry(ARGV[1], id, now) end
return out
"""
)

# KEYS: bindings hash. ARGV: prefix, sandbox id. The binding (none: {}) and its node, at once.
_LOCATE = (
    _NOW
    + _NODE_ENTRY
    + """
local raw = redis.call('HGET', KEYS[1], ARGV[2])
if not raw then return {} end
return {raw, tostring(now), node_record(ARGV[1], cjson.decode(raw).node_id)}
"""
)

# KEYS: nodes set, bindings hash, placing hash. ARGV: prefix, memory, vcpus, ttl, down_after,
# template's catalog name (or ''), kind, sandbox id (or ''), '1' to bind it (a create), token,
# template as requested, excluded node ids. Chooses and reserves in one step, so no other
# placement can spend the room in between: the best node with room (`scheduler` explains the
# order) among a sample (see `PLACE_SAMPLE`), or {} when no node has. A create placed already
# under the same name and token whose node has not bound it yet is a retry (a client resending
# after the answer was lost, perhaps to another scheduler): it answers the node of the first
# placement and reserves nothing more.
_PLACE = (
    _NOW
    + _NODE_ENTRY
    + f"local SAMPLE = {PLACE_SAMPLE}\n"
    + """
local prefix, memory = ARGV[1], tonumber(ARGV[2])
if ARGV[9] ~= '' then
  local placed = redis.call('HGET', KEYS[3], ARGV[8])
  if placed then  -- a retry of this create's placement, whose answer was lost: the same node
    local node, _, member = string.match(placed, '^(%S+) (%S+) (%S+)$')
    if member == ARGV[10] .. ':' .. ARGV[2] .. ':' .. ARGV[3] then
      return {tostring(now), node_record(prefix, node)}
    end
  end
end
local excluded = {}
for i = 12, #ARGV do excluded[ARGV[i]] = true end
local home, durable = nil, true
if ARGV[7] == 'resume' then
  local raw = redis.call('HGET', KEYS[2], ARGV[8])
  if not raw then return redis.error_reply('AENV_UNBOUND ' .. ARGV[8]) end
  local bound = cjson.decode(raw)
  home, durable = bound.node_id, bound.durable
end
local function before(a, b)
  for i = 1, #a do if a[i] ~= b[i] then return a[i] < b[i] end end
  return false
end
local best, best_key = nil, nil
local function consider(id)
  if excluded[id] then return end  -- before reading it: a create that mounts volumes excludes all but one
  local f = redis.call('HMGET', prefix .. 'node:' .. id, 'status', 'heartbeat_at', 'capacity', 'usage',
    'cached')
  if f[1] and not excluded[id] then
    local status = f[1]
    if now - tonumber(f[2]) > tonumber(ARGV[5]) then status = 'down' end
    local capacity, usage = cjson.decode(f[3]), cjson.decode(f[4])
    local reserved = redis.call('ZRANGEBYSCORE', prefix .. 'reserved:' .. id, now, '+inf')
    local pending = redis.call('HVALS', prefix .. 'pending:' .. id)
    local memory_spent, vcpus_spent = 0, 0
    for _, entry in ipairs(reserved) do
      local m, c = string.match(entry, ':(%d+):(%d+)$')
      memory_spent, vcpus_spent = memory_spent + m, vcpus_spent + c
    end
    for _, entry in ipairs(pending) do
      local m, c = string.match(entry, '^(%d+):(%d+)$')
      memory_spent, vcpus_spent = memory_spent + m, vcpus_spent + c
    end
    local free = capacity.memory_mib - usage.memory_mib - memory_spent
    local eligible = status == 'up' and durable
    if id == home then eligible = status == 'up' or (not durable and status == 'draining') end
    if eligible and capacity.disk_free_mib > 0 and free >= memory then
      local cached = ARGV[6] == ''
      for _, name in ipairs(cjson.decode(f[5])) do cached = cached or name == ARGV[6] end
      local key = {id == home and 0 or 1, cached and 0 or 1, usage.running + #reserved + #pending, -free,
        -(capacity.vcpus - usage.vcpus - vcpus_spent)}
      if best == nil or before(key, best_key) or (not before(best_key, key) and id < best) then
        best, best_key = id, key
      end
    end
  end
end
local seen = {}
local function consider_all(ids)
  for _, id in ipairs(ids) do
    if not seen[id] then seen[id] = true consider(id) end
  end
end
if home then consider_all({home}) end
if ARGV[6] ~= '' then consider_all(redis.call('SRANDMEMBER', prefix .. 'cached:' .. ARGV[6], SAMPLE)) end
consider_all(redis.call('SRANDMEMBER', KEYS[1], SAMPLE))
if not best then consider_all(redis.call('SMEMBERS', KEYS[1])) end
if not best then return {} end
local member = ARGV[10] .. ':' .. ARGV[2] .. ':' .. ARGV[3]
local expiry = now + tonumber(ARGV[4])
if ARGV[9] ~= '' then
  local killed = redis.call('EXISTS', prefix .. 'tombstone:' .. ARGV[8]) == 1
  if killed or redis.call('HEXISTS', KEYS[2], ARGV[8]) == 1 then
    return redis.error_reply('AENV_TAKEN ' .. ARGV[8])
  end
  local binding = {sandbox_id = ARGV[8], node_id = best, state = 'running', template_id = ARGV[11],
    durable = false}
  redis.call('HSET', KEYS[2], ARGV[8], cjson.encode(binding))
  redis.call('SADD', prefix .. 'bound:' .. best, ARGV[8])
  redis.call('HSET', KEYS[3], ARGV[8], best .. ' ' .. tostring(expiry) .. ' ' .. member)
end
redis.call('ZREMRANGEBYSCORE', prefix .. 'reserved:' .. best, '-inf', now)
redis.call('ZADD', prefix .. 'reserved:' .. best, expiry, member)
return {tostring(now), node_record(prefix, best)}
"""
)

_BINDINGS = TypeAdapter(list[Binding])


@dataclass(frozen=True)
class NodeRoom:
    """A node with what it can still take: its capacity less its usage, its reservations and
    the sandboxes started since its last heartbeat (`starting` counts those two)."""

    node: NodeInfo
    memory_mib: int
    vcpus: int
    starting: int


def _spent(entries: list[str]) -> tuple[int, int]:
    """Memory and vCPUs of reservation members (`token:mem:vcpus`) or pending values (`mem:vcpus`)."""
    parts = [entry.rsplit(":", 2)[-2:] for entry in entries]
    return sum(int(m) for m, _ in parts), sum(int(c) for _, c in parts)


class ClusterState:
    """The cluster's records in one Redis database (see the module's key layout)."""

    def __init__(
        self,
        redis: Redis,
        *,
        down_after: float,
        reservation_ttl: float = RESERVATION_TTL,
        tombstone_ttl: float = Settings.tombstone_ttl,
    ):
        self.redis = redis
        self.down_after = down_after
        self.reservation_ttl = reservation_ttl
        self.tombstone_ttl = tombstone_ttl
        self._scripts = {
            name: redis.register_script(source)
            for name, source in {
                "register": _REGISTER,
                "heartbeat": _HEARTBEAT,
                "set_status": _SET_STATUS,
                "place": _PLACE,
                "bind": _BIND,
                "unbind": _UNBIND,
                "tombstone": _TOMBSTONE,
                "rooms": _ROOMS,
                "locate": _LOCATE,
            }.items()
        }

    @classmethod
    def from_url(cls, url: str, *, down_after: float, **options: float) -> ClusterState:
        """Over at most `REDIS_CONNECTIONS` connections; a command waits for a free one (up to
        `REDIS_WAIT` s, then ConnectionError: Unavailable)."""
        pool = BlockingConnectionPool.from_url(
            url, decode_responses=True, max_connections=REDIS_CONNECTIONS, timeout=REDIS_WAIT
        )
        return cls(Redis(connection_pool=pool), down_after=down_after, **options)

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
            if reason == "AENV_TAKEN":
                raise Conflict(f"sandbox {ids[0]} is bound already") from None
            if reason == "AENV_UNBOUND":
                raise NotFound(f"sandbox {ids[0]} is not bound to any node") from None
            if reason == "AENV_KILLED":
                raise SandboxKilled(f"sandbox {ids[0]} was killed: it is not bound again") from None
            raise

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
        rooms = await self.rooms([node_id])
        if not rooms:
            raise NotFound(f"node {node_id} is not registered")
        return rooms[0].node

    async def nodes(self) -> list[NodeInfo]:
        return [room.node for room in await self.rooms()]

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

    def _record(self, entry: list[Any], now: float) -> NodeInfo | None:
        """A node record or entry of the scripts (`_NODE_ENTRY`) as its node; None if unregistered."""
        fields = dict(zip(entry[1][::2], entry[1][1::2], strict=True))
        return self._node(fields, now) if "info" in fields else None

    def _room(self, entry: list[Any], now: float) -> NodeRoom | None:
        """A node entry of the scripts (`_NODE_ENTRY`) as its room; None for an unregistered node."""
        _, _, reserved, pending = entry
        if (node := self._record(entry, now)) is None:
            return None
        memory, vcpus = _spent(reserved + pending)
        return NodeRoom(
            node=node,
            memory_mib=node.capacity.memory_mib - node.usage.memory_mib - memory,
            vcpus=node.capacity.vcpus - node.usage.vcpus - vcpus,
            starting=len(reserved) + len(pending),
        )

    async def rooms(self, node_ids: list[str] | None = None) -> list[NodeRoom]:
        """The nodes (all registered ones, or those of `node_ids`) with the room each has left,
        by id, read in one round trip."""
        raw = await self._run("rooms", [f"{PREFIX}nodes"], [PREFIX, *(node_ids or [])])
        now = float(raw[0])
        rooms = [room for entry in raw[1:] if (room := self._room(entry, now)) is not None]
        return sorted(rooms, key=lambda r: r.node.node_id)

    async def locate(self, sandbox_id: str) -> tuple[Binding, NodeInfo | None]:
        """The sandbox's binding and its node (None if the node left), read in one round trip."""
        raw = await self._run("locate", [f"{PREFIX}bindings"], [PREFIX, sandbox_id])
        if not raw:
            raise NotFound(f"sandbox {sandbox_id} is not bound to any node")
        return Binding.model_validate_json(raw[0]), self._record(raw[2], float(raw[1]))

    async def caching(self, snapshot_id: str) -> set[str]:
        """The ids of the nodes whose last heartbeat listed the template or snapshot as cached."""
        return set(await self.redis.smembers(f"{PREFIX}cached:{snapshot_id}"))

    # -- placement -------------------------------------------------------------------------

    async def place(self, request: Placement, template: str) -> NodeInfo | None:
        """Choose a node for the request and reserve its room there, atomically (see `_PLACE`); a
        create that names its sandbox is bound there in the same step. `template` is the
        request's as the nodes' caches name it. None when no node has room; Conflict if the
        sandbox is bound already; NotFound for a resume of an unbound one."""
        named = request.kind == "create" and bool(request.sandbox_id)
        token = request.sandbox_id or secrets.token_hex(8)  # a resume's is its sandbox's (`release`)
        keys = [f"{PREFIX}nodes", f"{PREFIX}bindings", f"{PREFIX}placing"]
        args = [PREFIX, request.memory_mib, request.vcpus, self.reservation_ttl, self.down_after, template,
                request.kind, request.sandbox_id or "", "1" if named else "", token, request.template,
                *request.exclude]  # fmt: skip
        raw = await self._run("place", keys, args)
        if not raw:
            return None
        node = self._record(raw[1], float(raw[0]))
        assert node is not None  # the script chose a registered node
        return node

    # -- bindings --------------------------------------------------------------------------

    async def bind(self, binding: Binding, *, observed: bool = False) -> None:
        """Record where the sandbox is; NotFound for an unregistered node, Conflict when a node
        reports as paused a sandbox bound to another node now. A sandbox moves between nodes only
        by starting on the new one (a take-over), so that node's report is late: the sandbox
        was taken over from it, and may be paused again over there. A bind of an older
        generation than the node's binding of the sandbox is late too, and is dropped."""
        node = binding.node_id
        keys = [f"{PREFIX}bindings", f"{PREFIX}node:{node}", f"{PREFIX}bound:{node}",
                f"{PREFIX}reserved:{node}", f"{PREFIX}pending:{node}", f"{PREFIX}placing"]  # fmt: skip
        if observed:
            binding = binding.model_copy(update={"durable": False})
        args = [PREFIX, binding.sandbox_id, binding.model_dump_json(), node, binding.state, int(observed),
                binding.generation]  # fmt: skip
        await self._run("bind", keys, args)

    async def release(self, request: Placement, node_id: str) -> None:
        """Drop the reservation a resume's placement made on `node_id` (named by its sandbox, as
        `_PLACE` names it)."""
        member = f"{request.sandbox_id}:{request.memory_mib}:{request.vcpus}"
        await self.redis.zrem(f"{PREFIX}reserved:{node_id}", member)

    async def unbind(self, sandbox_id: str, node_id: str) -> bool:
        """Forget the sandbox if it is bound to `node_id` (with its reservation, if its create
        never ended); whether it was."""
        keys = [f"{PREFIX}bindings", f"{PREFIX}placing"]
        return bool(await self._run("unbind", keys, [PREFIX, sandbox_id, node_id]))

    async def tombstone(self, sandbox_id: str, node_id: str) -> Binding:
        """Kill the sandbox in the records while `node_id`, its node, cannot be reached: unbind
        it and leave its tombstone, atomically (see the module's docstring); the binding it had.
        NotFound if it is not bound, Conflict if it is bound to another node now."""
        keys = [f"{PREFIX}bindings", f"{PREFIX}placing"]
        args = [PREFIX, sandbox_id, node_id, max(1, int(self.tombstone_ttl * 1000))]
        return Binding.model_validate_json(await self._run("tombstone", keys, args))

    async def binding(self, sandbox_id: str) -> Binding:
        raw = await self.redis.hget(f"{PREFIX}bindings", sandbox_id)
        if raw is None:
            raise NotFound(f"sandbox {sandbox_id} is not bound to any node")
        return Binding.model_validate_json(raw)

    async def bindings(self, node_id: str | None = None) -> list[Binding]:
        """All bindings, or those `node_id` answers for: less its creates still under way (placing,
        their reservation not expired), which it binds itself when they end."""
        if node_id is None:
            raws = list((await self.redis.hgetall(f"{PREFIX}bindings")).values())
        else:
            ids = sorted(await self.redis.smembers(f"{PREFIX}bound:{node_id}"))
            pipe = self.redis.pipeline(transaction=False)
            pipe.time()
            pipe.hmget(f"{PREFIX}bindings", ids)
            pipe.hmget(f"{PREFIX}placing", ids)
            (seconds, micros), found, placing = await pipe.execute() if ids else ((0, 0), [], [])
            now = seconds + micros / 1e6
            pairs = zip(found, placing, strict=True)
            raws = [raw for raw, placed in pairs if raw and not _under_way(placed, now)]
        bindings = _BINDINGS.validate_json("[" + ",".join(raws) + "]")
        return sorted(bindings, key=lambda b: b.sandbox_id)


def _under_way(placed: str | None, now: float) -> bool:
    """Whether a `placing` entry is of a create that may still be running (its room reserved)."""
    return placed is not None and float(placed.split(" ")[1]) > now
