"""freeze_heap: garbage made before it is freed, survivors leave the collected generations,
and later cycles are still collected. Run in a fresh interpreter, so the test process's own
collector is left as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_freeze_heap_frees_garbage_freezes_survivors_and_keeps_collecting() -> None:
    script = textwrap.dedent(
        """
        import gc, weakref
        from afd_protocol import freeze_heap

        class Node:
            pass

        def cycle():
            a, b = Node(), Node()
            a.other, b.other = b, a
            return weakref.ref(a)

        kept = [Node() for _ in range(1000)]
        dead = cycle()                        # garbage before the freeze
        assert gc.get_freeze_count() == 0
        frozen = freeze_heap()
        assert dead() is None, "a cycle made before the freeze was not freed"
        assert frozen == gc.get_freeze_count() >= len(kept), (frozen, gc.get_freeze_count())
        tracked = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
        assert not any(id(o) in tracked for o in kept), "a survivor is still collected"
        later = cycle()                       # garbage made while serving
        gc.collect()
        assert later() is None, "the collector no longer frees new cycles"
        assert gc.isenabled()
        again = freeze_heap()
        assert again >= frozen, (again, frozen)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
