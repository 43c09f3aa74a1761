"""Tensor transport between SpecOffload processes: shared-memory arenas, msgpack headers, ZeroMQ sockets.

The actor runtime runs the target verifier, draft generator, CPU attention worker and weight loader in separate
processes. Tensors never travel on a socket: the producer writes them into a pre-allocated shared-memory arena
(`arena`), and a small typed message (`codec`) carries a `TensorRef` header (arena name, offset, dtype, shape)
over ZeroMQ (`channel`). The consumer maps the same arena and reads a zero-copy view. No pickle anywhere.

    arena.py    Arena: one owner creates (and unlinks) a /dev/shm file, others attach; allocator; sweep of dead
                owners' files
    codec.py    @message wire dataclasses, encode/decode (msgpack, strict), write_tensor/read_tensor
    channel.py  ChannelConfig (addresses derived from name + pid), Server/Client (ROUTER/DEALER), Pusher/Puller
    shm.py      ShmTensors: a process's own output arenas by key plus the arenas it attached; sweep of dead
                processes' ipc sockets
    procs.py    pid_alive (a zombie counts as dead), the one liveness test of every sweep and watchdog

Like the rest of `runtime/`, this package never imports Ray.
"""
