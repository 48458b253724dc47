"""A trainer on the ckptd bindings alone (no PyTorch), for the installed wheel's tests.

usage: wheel_trainer.py SOCKET JOB save     saves steps 1 to 3, each committed, prints
                                            "saved 3", then trains on until it is killed
       wheel_trainer.py SOCKET JOB resume   restores the latest step into fresh buffers and
                                            prints "resumed step 3 bit-exact" if it is step 3's
                                            values, whatever the killed trainer did after it
Both print where ckptd was imported from first ("ckptd from PATH").
"""
import array
import sys
import time

import ckptd

N = 4096


def values(step):
    # Different at every step and element, exact in float32.
    return array.array("f", [float(step * 10000 + i) for i in range(N)])


def main(socket, job, mode):
    print("ckptd from", ckptd._native.__file__, flush=True)
    client = ckptd.connect(socket, job, arena_bytes=16 << 20)
    weights = memoryview(client.allocate("w", "F32", [N])).cast("B").cast("f")
    client.register()
    if mode == "save":
        for step in (1, 2, 3):
            weights[:] = values(step)
            state = client.wait_committed(client.snapshot(step), timeout=120)
            if state["state"] != "committed":
                sys.exit(f"step {step}: {state}")
        print("saved 3", flush=True)
        step = 4
        while True:  # training goes on, changing the buffers, until SIGKILL
            weights[:] = values(step)
            step += 1
            time.sleep(0.01)
    restored = client.restore()
    same = restored["found"] and restored["step"] == 3 and weights.tobytes() == values(3).tobytes()
    print(f"resumed step {restored['step']} {'bit-exact' if same else 'WRONG'}", flush=True)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
