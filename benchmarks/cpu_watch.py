"""CPU accounting of the benchmark suite vs everyone else, as a small helper process.

    python -m benchmarks.cpu_watch ROOT_PID

Every ``INTERVAL_S`` it reads ``/proc`` and adds each process's new CPU time (utime +
stime) to "own" (ROOT_PID's descendants, and processes whose command line names a
marker) or to "foreign". Per-process tracking is needed because Ray's raylet does not
reap its workers into its own counters, so short-lived actor processes would otherwise
look like someone else's work. Commands on stdin, one per line:
``marker TEXT`` adds a marker (a ``ray start`` head's temp dir); ``mark`` prints one
JSON line ``{"own", "foreign", "total"}``: cumulative clock ticks since the start.

It runs in its own process so that its scans never take the GIL of a timed loop.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

INTERVAL_S = 0.5


class Watcher:
    def __init__(self, root: int) -> None:
        self.root = root
        self.markers: list[bytes] = []
        self.lock = threading.Lock()
        self.seen: dict[int, tuple[bool, int]] = {}  # pid -> (own, last cpu ticks)
        self.own = self.foreign = 0
        self.first_scan = True
        self.total0 = self._machine_total()
        self.scan()

    @staticmethod
    def _machine_total() -> int:
        with open("/proc/stat") as handle:
            return sum(int(v) for v in handle.readline().split()[1:])

    def _processes(self) -> dict[int, tuple[int, int]]:
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    text = handle.read()
            except OSError:
                continue
            fields = text[text.rfind(")") + 2 :].split()
            found[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        return found

    def _has_marker(self, pid: int) -> bool:
        if not self.markers:
            return False
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            return False
        return any(marker in cmdline for marker in self.markers)

    def _is_own(self, pid: int, processes: dict[int, tuple[int, int]]) -> bool:
        for _ in range(64):  # walk up the parents
            if pid == self.root or self._has_marker(pid):
                return True
            known = self.seen.get(pid)
            if known is not None and known[0]:
                return True
            if pid not in processes or pid <= 1:
                return False
            pid = processes[pid][0]
        return False

    def scan(self) -> None:
        with self.lock:
            processes = self._processes()
            for pid, (_, ticks) in processes.items():
                if pid in self.seen:
                    own, last = self.seen[pid]
                else:
                    # Processes alive at the first scan count from then on; later ones
                    # from their start.
                    own, last = self._is_own(pid, processes), ticks if self.first_scan else 0
                delta = max(ticks - last, 0)
                if own:
                    self.own += delta
                else:
                    self.foreign += delta
                self.seen[pid] = (own, ticks)
            self.first_scan = False

    def mark(self) -> dict[int, int]:
        self.scan()
        return {
            "own": self.own,
            "foreign": self.foreign,
            "total": self._machine_total() - self.total0,
        }


def main() -> None:
    watcher = Watcher(int(sys.argv[1]))

    def loop() -> None:
        while True:
            time.sleep(INTERVAL_S)
            watcher.scan()

    threading.Thread(target=loop, daemon=True).start()
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "marker":
            with watcher.lock:
                watcher.markers.append(argument.encode())
        elif command == "mark":
            print(json.dumps(watcher.mark()), flush=True)


if __name__ == "__main__":
    main()
