"""cluster_hub.py - the Ethernet switch of one segment of cluster.sh's guests (the `switch` topology's data
segment, and every topology's management segment): each guest's NIC is a QEMU `-netdev dgram` whose local end
is a unix datagram socket of its own and whose remote end is this hub's socket. A frame goes to the port that
last sent from its destination MAC, else (broadcast, multicast, not yet learned) to every other port.

    python3 cluster_hub.py HUB_SOCKET PORT_SOCKET...     (runs until killed)
"""

import os
import socket
import sys


def main():
    hub, ports = sys.argv[1], sys.argv[2:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if os.path.exists(hub):
        os.unlink(hub)
    sock.bind(hub)
    learned = {}  # MAC -> port socket path
    while True:
        frame, src = sock.recvfrom(65536)
        if len(frame) < 14 or src not in ports:
            continue
        learned[frame[6:12]] = src
        dst = learned.get(frame[0:6]) if not frame[0] & 1 else None
        for port in [dst] if dst else ports:
            if port != src:
                try:
                    sock.sendto(frame, socket.MSG_DONTWAIT, port)
                except OSError:  # that guest is not up yet, gone, or its queue is full: the frame is lost
                    pass


if __name__ == "__main__":
    main()
