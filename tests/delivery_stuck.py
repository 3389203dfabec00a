"""A process whose delivery is stuck on a hung server (run as a subprocess by tests/test_delivery.py): it
publishes version 1 to the servers announced in RUN_DIR, waits for the test to say the update is under way
(a line on stdin), closes the delivery (wait_s 2) and returns from main; the test times the exit.

Usage: python delivery_stuck.py RUN_DIR BROADCAST_PORT
"""

import sys
import time

from memory_servers import TOKEN, Trainer, metas

from pipelinerl.control import ControlClient
from pipelinerl.rundir import server_roster
from pipelinerl.weights import Delivery, Publication, WeightBroadcaster


def main() -> None:
    run_dir, port = sys.argv[1], int(sys.argv[2])
    sender = WeightBroadcaster([], "gloo", "127.0.0.1", port, 600.0, bucket_bytes=2048, token=TOKEN, delta=True)
    publication = Publication()
    delivery = Delivery(publication, lambda: server_roster(run_dir), sender, ControlClient(TOKEN, 5.0)).start()
    wire = Trainer().wire()
    publication.publish(1, metas(wire), list(wire.values()))
    sys.stdin.readline()
    started = time.monotonic()
    delivery.close(wait_s=2.0)
    print(f"closed in {time.monotonic() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
