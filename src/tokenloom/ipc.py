"""The channel between a process and the processes it spawns: ZeroMQ PUSH/PULL sockets on ipc:// paths carrying
pickled messages (the engine core process, tensor-parallel workers)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq


@contextmanager
def child_end(inputs_path: str, outputs_path: str) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """A spawned process's end of its channel: a PULL socket for what it is sent, a PUSH socket for what it says.
    Closed on exit, giving what it said last a second to leave."""
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(inputs_path)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_path)
    try:
        yield inputs, outputs
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)
        context.term()


def send(socket: zmq.Socket[bytes], message: Any, flags: int = 0) -> None:
    socket.send(pickle.dumps(message, protocol=5), flags)


def broadcast(sockets: list[zmq.Socket[bytes]], message: Any) -> None:
    """The same message on every socket, pickled once."""
    payload = pickle.dumps(message, protocol=5)
    for socket in sockets:
        socket.send(payload)


def receive(socket: zmq.Socket[bytes], flags: int = 0) -> Any:
    return pickle.loads(socket.recv(flags))
