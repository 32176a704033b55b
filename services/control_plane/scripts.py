"""Lua scripts: every state change is one atomic script fenced on the current generation.

Each script first compares ``cur:<engine>`` with the caller's generation, so a worker or host of
an older generation can never write over the current one (generation fencing). Scripts that
change state publish their event themselves, atomically with the change.

Return codes shared by the scripts: ``-1`` the engine has no live lease, ``-2`` the caller's
generation is stale.
"""

# KEYS: gen_counter
# ARGV: now_ms
# The next generation: above the previous one and at least the wall clock in milliseconds, so
# that it stays unique even when Redis restarts without persistence and forgets the counter
# (a restarted engine must never reuse the generation of its dead predecessor).
NEXT_GENERATION = """
local previous = tonumber(redis.call('GET', KEYS[1]) or '0')
local generation = math.max(previous + 1, tonumber(ARGV[1]))
redis.call('SET', KEYS[1], string.format('%d', generation))
return generation
"""

# KEYS: gen_counter, cur, engine, status, load, hs, owners, hsver, engines_zset, events
# ARGV: generation, engine_bytes, status_bytes, ttl_ms, engine_id, score, event_bytes
REGISTER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -2 end
local ttl = tonumber(ARGV[4])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ttl)
redis.call('SET', KEYS[3], ARGV[2], 'PX', ttl)
redis.call('SET', KEYS[4], ARGV[3], 'PX', ttl)
redis.call('DEL', KEYS[5], KEYS[6], KEYS[7], KEYS[8])
redis.call('ZADD', KEYS[9], ARGV[6], ARGV[5])
redis.call('PUBLISH', KEYS[10], ARGV[7])
return 1
"""

# KEYS: cur, engine, status, load, hs, owners, hsver, engines_zset
# ARGV: generation, ttl_ms, load_bytes (may be empty: keep the previous load), engine_id, score
# The ZADD NX puts the id back into the index should it ever be missing while the lease lives
# (PRUNE_EXPIRED no longer removes a live engine; this is the belt to its braces).
HEARTBEAT = """
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
if cur ~= ARGV[1] then return -2 end
local ttl = tonumber(ARGV[2])
if ARGV[3] ~= '' then redis.call('SET', KEYS[4], ARGV[3], 'PX', ttl) end
for i = 1, 7 do redis.call('PEXPIRE', KEYS[i], ttl) end
redis.call('ZADD', KEYS[8], 'NX', ARGV[5], ARGV[4])
return 1
"""

# KEYS: engines_zset, then cur of each candidate
# ARGV: the candidates' engine ids, in the order of their cur keys
# Removes from the index only the candidates whose lease is still gone, in the same step as
# the check: a candidate that registered again since the caller read it expired stays.
# Returns the removed ids.
PRUNE_EXPIRED = """
local removed = {}
for i = 1, #ARGV do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then
    redis.call('ZREM', KEYS[1], ARGV[i])
    removed[#removed + 1] = ARGV[i]
  end
end
return removed
"""

# KEYS: cur, engine, status, load, hs, owners, hsver, engines_zset, events
# ARGV: generation, engine_id, event_bytes
DEREGISTER = """
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
if cur ~= ARGV[1] then return -2 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('ZREM', KEYS[8], ARGV[2])
redis.call('PUBLISH', KEYS[9], ARGV[3])
return 1
"""

# KEYS: cur, engine, hs, owners, hsver, events
# ARGV: generation, ttl_ms, expected_ranks, event_bytes, then (field, worker_id, record) triples
# Returns {code} on failure ({-3, field, owner} for a duplicate rank), {version, n} while the
# grid is incomplete and {version, n, engine_bytes, field1, value1, ...} once it is complete:
# the caller that completes the grid gets everything it needs to aggregate in the same trip.
PUBLISH_HANDSHAKES = """
local cur = redis.call('GET', KEYS[1])
if not cur then return {-1} end
if cur ~= ARGV[1] then return {-2} end
for i = 5, #ARGV, 3 do
  local owner = redis.call('HGET', KEYS[4], ARGV[i])
  if owner and owner ~= ARGV[i + 1] then return {-3, ARGV[i], owner} end
end
for i = 5, #ARGV, 3 do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 2])
  redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1])
end
local ttl = tonumber(ARGV[2])
local version = redis.call('INCR', KEYS[5])
redis.call('PEXPIRE', KEYS[3], ttl)
redis.call('PEXPIRE', KEYS[4], ttl)
redis.call('PEXPIRE', KEYS[5], ttl)
redis.call('PUBLISH', KEYS[6], ARGV[4])
local n = redis.call('HLEN', KEYS[3])
if n < tonumber(ARGV[3]) then return {version, n} end
local reply = {version, n, redis.call('GET', KEYS[2])}
local all = redis.call('HGETALL', KEYS[3])
for i = 1, #all do reply[#reply + 1] = all[i] end
return reply
"""

# KEYS: cur, hs, owners, hsver, events
# ARGV: generation, field, worker_id, event_bytes
# Returns the new handshake version, 0 when the rank was not held by that worker.
WITHDRAW_HANDSHAKE = """
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
if cur ~= ARGV[1] then return -2 end
if redis.call('HGET', KEYS[3], ARGV[2]) ~= ARGV[3] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
local version = redis.call('INCR', KEYS[4])
redis.call('PUBLISH', KEYS[5], ARGV[4])
return version
"""

# KEYS: cur, status, hsver, events
# ARGV: generation, handshake_version, status_bytes, event_bytes
# Compare-and-set: the status is written only if no handshake changed since it was computed.
# Returns 1 when written, 0 when superseded by a newer handshake version.
SET_STATUS = """
local cur = redis.call('GET', KEYS[1])
if not cur then return -1 end
if cur ~= ARGV[1] then return -2 end
if (redis.call('GET', KEYS[3]) or '0') ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[2], ARGV[3], 'KEEPTTL')
redis.call('PUBLISH', KEYS[4], ARGV[4])
return 1
"""
