#!/usr/bin/env python3
"""A scripted AMQP 0-9-1 peer for the broker suite: it says what a real
RabbitMQ says only by chance, on purpose and every time.

    fake_amqp.py PORT MODE

MODE ack-then-block: the first publish is acked at once, and 50 ms later
the connection is blocked (connection.blocked, as under a memory alarm),
after which nothing more is read.  RabbitMQ's reader sends the block and
its channel the ack; either may come first.

MODE reset-at-the-batch: the two alarm probes of the connect are acked,
and the next publish, a batch's first, resets the connection (RST) with
the rest of the batch unread: a batch larger than the socket buffers is
cut short mid-send.

MODE close-at-the-probe: the connect's first publish (the alarm probe) is
answered with connection.close 320 CONNECTION_FORCED, as by a node that
is shutting down.

MODE return-after-block: the connect's alarm probes are acked.  The
next publish, a batch's first, is answered with connection.blocked, and
nothing of that batch is confirmed.  1.5 s later (times
OUTBOXD_TEST_SLOWDOWN) comes connection.unblocked.  The next method on
channel 1 after that (the next batch's publish, or a channel.close) is
first answered with what a real broker still owed the blocked batch: a
basic.return of its first message (NO_ROUTE) and an ack of its last;
what comes later is acked.

MODE close-every-round: the connect's alarm probes are acked.  From then
on, 300 ms after the first publish on a freshly opened channel 1, the
broker closes the channel (406, for no reason the message could show);
nothing is ever acked.  A channel.close from the client is answered
with close-ok, crossing ours or instead of it.

MODE close-then-block: the connect's alarm probes are acked.  The next
publish, a batch's first, is answered with channel.close (406, for no
reason the message could show) and connection.blocked in one segment,
after which nothing more is read: RabbitMQ's channel and reader send
the two apart, in either order.

MODE block-close-late: the connect's alarm probes are acked.  At the
next publish, a batch's first, the fake stops reading; a second later
(times OUTBOXD_TEST_SLOWDOWN), with the client's socket buffers full of
the batch, come connection.blocked and then channel.close (406) in one
segment, after which nothing more is read.

MODE unblock-before-deadline: the connect's alarm probes are acked.
The next publish, a batch's first, is answered with connection.blocked,
and 300 ms later (times OUTBOXD_TEST_SLOWDOWN) with
connection.unblocked; nothing is acked until channel 1 is opened again
(the late confirms of a broker working off its alarm's backlog).

It prints "ready" once it listens, and serves until killed.
"""
import os
import select
import socket
import struct
import sys
import threading
import time

# The suites' factor for slow runs (sanitizers, valgrind): the fake's
# unblock must still come after the client's confirm timeout.
SLOWDOWN = max(1, int(os.environ.get("OUTBOXD_TEST_SLOWDOWN", "1") or 1))


def frame(kind, channel, payload):
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"


def method(channel, cls, mid, args=b""):
    return frame(1, channel, struct.pack(">HH", cls, mid) + args)


def longstr(b):
    return struct.pack(">I", len(b)) + b


def shortstr(b):
    return struct.pack(">B", len(b)) + b


def recv_exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def read_frame(sock):
    kind, channel, size = struct.unpack(">BHI", recv_exactly(sock, 7))
    payload = recv_exactly(sock, size)
    recv_exactly(sock, 1)
    return kind, channel, payload


def basic_ack(channel, tag, multiple=False):
    return method(channel, 60, 80, struct.pack(">QB", tag, multiple))


def serve(sock, mode):
    tags = {}
    timer = None            # (when, frames to send then)
    blocked = None          # return-after-block: the batch's first message
    owed = b""              # what is sent before the next method on ch 1
    closing = False         # close-every-round: awaiting our close-ok
    published = 0           # on this connection: the first 2 are probes
    holding = False         # unblock-before-deadline: no acks for now
    try:
        recv_exactly(sock, 8)  # protocol header
        sock.sendall(method(0, 10, 10, b"\x00\x09" + struct.pack(">I", 0) +
                            longstr(b"PLAIN") + longstr(b"en_US")))
        while True:
            wait = None if timer is None else max(0, timer[0] - time.time())
            if not select.select([sock], [], [], wait)[0]:
                sock.sendall(timer[1])
                timer = None
                if blocked is not None:     # unblocked: the debt is due
                    owed = (method(1, 60, 50, struct.pack(">H", 312) +
                                   shortstr(b"NO_ROUTE") + shortstr(b"") +
                                   shortstr(b"q")) +
                            frame(2, 1, blocked["header"]) +
                            frame(3, 1, blocked["body"]) +
                            basic_ack(1, blocked["tag"], True))
                continue
            kind, channel, payload = read_frame(sock)
            if blocked is not None and blocked["header"] is None:
                if kind == 2:
                    blocked["header"] = payload
                continue
            if blocked is not None and blocked["body"] is None:
                if kind == 3:
                    blocked["body"] = payload
                continue
            if kind != 1:
                continue
            cls, mid = struct.unpack(">HH", payload[:4])
            if channel == 1 and owed and timer is None:
                sock.sendall(owed)
                owed = b""
            if closing and channel == 1 and (cls, mid) == (20, 40):
                # The client closes too: answered, as RabbitMQ does.  If
                # our close is not sent yet, it never will be.
                sock.sendall(method(channel, 20, 41))
                if timer is not None:
                    timer, closing = None, False
                continue
            if closing and channel == 1 and (cls, mid) != (20, 41):
                continue
            if (cls, mid) == (10, 11):      # start-ok -> tune
                sock.sendall(method(0, 10, 30,
                                    struct.pack(">HIH", 2047, 131072, 0)))
            elif (cls, mid) == (10, 40):    # open -> open-ok
                sock.sendall(method(0, 10, 41, shortstr(b"")))
            elif (cls, mid) == (20, 10):    # channel.open -> open-ok
                sock.sendall(method(channel, 20, 11, longstr(b"")))
                holding = holding and channel != 1
            elif (cls, mid) == (20, 40):    # channel.close -> close-ok
                sock.sendall(method(channel, 20, 41))
            elif (cls, mid) == (20, 41):    # close-ok of our close
                closing = False
            elif (cls, mid) == (85, 10):    # confirm.select -> select-ok
                sock.sendall(method(channel, 85, 11))
                tags[channel] = 0
            elif (cls, mid) == (60, 40):    # basic.publish
                tags[channel] = tags.get(channel, 0) + 1
                tag = tags[channel]
                published += 1
                if mode == "ack-then-block":
                    sock.sendall(basic_ack(channel, tag))
                    time.sleep(0.05)
                    sock.sendall(method(0, 10, 60,
                                        shortstr(b"low on memory")))
                    time.sleep(3600)        # blocked: reads nothing more
                elif mode == "close-then-block" and published > 2:
                    sock.sendall(method(channel, 20, 40,
                                        struct.pack(">H", 406) +
                                        shortstr(b"PRECONDITION_FAILED - "
                                                 b"unexplained") +
                                        struct.pack(">HH", 60, 40)) +
                                 method(0, 10, 60,
                                        shortstr(b"low on memory")))
                    time.sleep(3600)        # blocked: reads nothing more
                elif mode == "block-close-late" and published > 2:
                    time.sleep(1.0 * SLOWDOWN)  # buffers fill meanwhile
                    sock.sendall(method(0, 10, 60,
                                        shortstr(b"low on memory")) +
                                 method(channel, 20, 40,
                                        struct.pack(">H", 406) +
                                        shortstr(b"PRECONDITION_FAILED - "
                                                 b"unexplained") +
                                        struct.pack(">HH", 60, 40)))
                    time.sleep(3600)        # blocked: reads nothing more
                elif mode == "close-at-the-probe":
                    sock.sendall(method(0, 10, 50, struct.pack(">H", 320) +
                                        shortstr(b"CONNECTION_FORCED - "
                                                 b"broker forced connection "
                                                 b"closure with reason "
                                                 b"'shutdown'") +
                                        struct.pack(">HH", 0, 0)))
                elif mode == "reset-at-the-batch":
                    if published > 2:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                        return              # closed with RST by finally
                    sock.sendall(basic_ack(channel, tag))
                elif (mode == "unblock-before-deadline" and
                      published == 3):
                    sock.sendall(method(0, 10, 60,
                                        shortstr(b"low on memory")))
                    holding = True
                    timer = (time.time() + 0.3 * SLOWDOWN,
                             method(0, 10, 61))
                elif holding:
                    pass                    # its confirms come late
                elif (mode == "return-after-block" and published == 3):
                    sock.sendall(method(0, 10, 60,
                                        shortstr(b"low on memory")))
                    blocked = {"tag": tag, "header": None, "body": None}
                    timer = (time.time() + 1.5 * SLOWDOWN,
                             method(0, 10, 61))
                elif mode == "return-after-block" and timer is not None:
                    blocked["tag"] = tag    # the blocked batch's rest
                elif mode == "close-every-round":
                    if published <= 2:
                        sock.sendall(basic_ack(channel, tag))
                    elif timer is None and not closing:
                        closing = True
                        timer = (time.time() + 0.3, method(
                            channel, 20, 40, struct.pack(">H", 406) +
                            shortstr(b"PRECONDITION_FAILED - "
                                     b"unexplained") +
                            struct.pack(">HH", 60, 40)))
                else:
                    sock.sendall(basic_ack(channel, tag))
            elif (cls, mid) == (10, 50):    # close -> close-ok
                sock.sendall(method(0, 10, 51))
    except (EOFError, OSError):
        pass
    finally:
        sock.close()


def main():
    port, mode = int(sys.argv[1]), sys.argv[2]
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn, mode), daemon=True).start()


if __name__ == "__main__":
    main()
