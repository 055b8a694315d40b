"""What a worker and the processes that outlive it agree on, and nothing else: the store
keys and the JSON messages (the timeouts they wait by live below, in ``odyssey_megatron.timeouts``).

The rank side (``runtime.rank``) and the control side (``runtime.control``) import this
package and never each other. Everything crosses the controller's TCPStore as JSON (never
pickle: a store is a network service). One module per concern:
- ``keys``: the store keys, generation by generation, and the values markers take;
- ``messages``: the JSON messages, each field type-checked on parse;
- ``plan_frame``: a plan published in slices (``write_plan``/``read_plan``): each live
  worker's op list under its own key, then a frame every worker reads (the message's
  fields, the plan in its column form, the step program's flags), all zlib-compressed
  JSON; a worker reads the frame and its own op list only, whatever the world's size, and
  no value comes near the store's request limit;
- ``liveness``: how a receiver judges a sender alive (``HeartbeatWatch``) and a store error
  a missed beat; senders stamp messages with their wall clock, receivers judge on their own
  monotonic clock by watching a heartbeat's sequence number change, so clock skew between
  nodes never fails a worker;
- ``launch``: what a launcher hands the worker it starts, and the exit statuses they agree on.

A *rank* here is a worker process's rank fixed at launch (``node * nproc_per_node +
local_rank``); plan worker ``w`` (a TP group) is ranks ``w*TP .. w*TP+TP-1``.
"""
