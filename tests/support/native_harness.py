"""A stand-in served process for tests/test_native_cupti.py (run as a subprocess).

It loads libridgeline_cupti.so with ctypes and drives its completed-buffer path
(``ridgeline_test_buffer_completed``, the same code CUPTI's callback runs) with buffers
from tests/support/cupti_records.py. Commands come one per line on stdin, answers go one JSON
line per command on stdout:

  init SOCKET CUPTI_VERSION        set the library up (sender thread starts)
  initcupti SOCKET LIBCUPTI        the same with a real libcupti deciding the record sizes
  feed SEED N_KERNELS [NPZ] [CORR0]  build a buffer, save expected records to NPZ, feed it
  feedspec JSON                    feed a buffer laid out by a spec (see _spec_buffer)
  idle TIMEOUT_MS                  wait until every pool slot is free
  counters | status | quit

``native_harness.py --stub LIB STUB`` is a stand-in served process on the real path
instead: the driver's part (InitializeInjection, with RIDGELINE_LIBCUPTI naming the stand-in
libcupti probes/native/tests/stub_cupti.c) and CUPTI's part (stub_record writes kernel
records into the current buffer as CUPTI does when kernels finish). Commands:

  emit N RATE_HZ CORR0   N kernel records, RATE_HZ a second (0: at once), in a thread
  emitted                wait for the emitter; {correlation id: monotonic time written}
  deliverspec JSON       a buffer laid out by a spec (_spec_buffer), delivered completed
  kineto_start | kineto_stop FINALIZE   torch.profiler's calls (stub_kineto_*)
  hold 1|0               a record in the current buffer is incomplete (a long kernel) / done
  log | counters | tid | sigterm | quit
With STUB_APP_OWN_SIGTERM=1 the process installs its own SIGTERM handler (exit 3) first.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run as a script: tests/ for `support`
from support import cupti_records as R  # noqa: E402

COUNTERS = ["dropped_cupti", "dropped_pool_full", "dropped_no_agent", "dropped_send", "sampled_out",
            "names_dropped", "walk_errors", "records_in", "records_sent", "batches_sent", "connects",
            "buffers_refused", "mode", "flags", "kernel_sample_every", "buffers_lost", "flushes", "takeovers",
            "reclaims", "clock_mapped", "clock_unmapped", "guest_sessions", "guest_records", "guest_buffers",
            "guest_dropped", "clock_pairs", "connects_busy"]


def _spec_buffer(spec: list[dict]) -> tuple[bytes, list]:
    """A buffer of records laid out by ``spec``: one dict per record with ``kind``,
    ``size`` and optional ``u32``/``u64`` ({offset: value}) and ``str`` ({offset: text},
    a pointer to a NUL-terminated copy of text that lives in this process, as CUPTI's
    name pointers do). Offsets come from the test (taken from a real header)."""
    strings, out = [], bytearray()
    for r in spec:
        rec = bytearray(r["size"])
        rec[0:4] = int(r["kind"]).to_bytes(4, "little", signed=True)
        for off, v in r.get("u32", {}).items():
            rec[int(off):int(off) + 4] = int(v).to_bytes(4, "little")
        for off, v in r.get("u64", {}).items():
            rec[int(off):int(off) + 8] = int(v).to_bytes(8, "little")
        for off, text in r.get("str", {}).items():
            b = ctypes.create_string_buffer(text.encode())
            strings.append(b)
            rec[int(off):int(off) + 8] = ctypes.addressof(b).to_bytes(8, "little")
        out += rec
    return bytes(out), strings


def main() -> int:
    lib = ctypes.CDLL(sys.argv[1])
    lib.ridgeline_test_init.argtypes = [ctypes.c_char_p, ctypes.c_uint32]
    lib.ridgeline_test_buffer_completed.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.ridgeline_test_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
    lib.ridgeline_test_status.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.ridgeline_test_status.restype = ctypes.c_size_t
    lib.ridgeline_test_record_size.restype = ctypes.c_uint32
    lib.ridgeline_test_init_cupti.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.ridgeline_test_layout.argtypes = [ctypes.c_char_p]
    lib.ridgeline_test_layout.restype = ctypes.c_long
    keep = []
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        out: dict = {}
        if cmd[0] == "init":
            out["rc"] = lib.ridgeline_test_init(cmd[1].encode(), int(cmd[2]))
            out["sizes"] = {k: lib.ridgeline_test_record_size(k) for k in (1, 2, 4, 5, 10, 12, 13, 39)}
        elif cmd[0] == "initcupti":
            out["rc"] = lib.ridgeline_test_init_cupti(cmd[1].encode(), cmd[2].encode())
            out["sizes"] = {k: lib.ridgeline_test_record_size(k) for k in (1, 2, 4, 5, 10, 12, 13, 39)}
        elif cmd[0] == "layout":
            out["value"] = lib.ridgeline_test_layout(cmd[1].encode())
        elif cmd[0] == "feedspec":
            data, strings = _spec_buffer(json.loads(line.split(None, 1)[1]))
            keep.append(strings)
            lib.ridgeline_test_buffer_completed(data, len(data))
            out["bytes"] = len(data)
            out["ptrs"] = [ctypes.addressof(x) for x in strings]
        elif cmd[0] == "feed":
            corr0 = int(cmd[4]) if len(cmd) > 4 else 1
            b = R.make_buffer(int(cmd[2]), seed=int(cmd[1]), corr0=corr0)
            keep.append(b)      # CUPTI's name strings outlive the buffer
            if len(cmd) > 3 and cmd[3] != "-":
                # raw bytes: cupti-python's dtypes have overlapping (union) fields numpy cannot save
                raw = {k: np.frombuffer(getattr(b, k).tobytes(), np.uint8)
                       for k in ("kernels", "copies", "memsets", "api", "markers", "extcorr")}
                np.savez(cmd[3], **raw,
                         name_ptrs=np.array(list(b.names), np.uint64), name_strs=np.array(list(b.names.values())))
            t = time.perf_counter_ns()
            lib.ridgeline_test_buffer_completed(b.data, len(b.data))
            out["call_ns"] = time.perf_counter_ns() - t
            out["bytes"] = len(b.data)
        elif cmd[0] == "idle":
            until = time.monotonic() + int(cmd[1]) / 1000
            while not lib.ridgeline_test_pool_idle() and time.monotonic() < until:
                time.sleep(0.005)
            out["idle"] = bool(lib.ridgeline_test_pool_idle())
        elif cmd[0] == "counters":
            arr = (ctypes.c_uint64 * len(COUNTERS))()
            n = lib.ridgeline_test_counters(arr, len(COUNTERS))
            out = {COUNTERS[i]: int(arr[i]) for i in range(n)}
        elif cmd[0] == "status":
            buf = ctypes.create_string_buffer(4096)
            lib.ridgeline_test_status(buf, 4096)
            out["status"] = buf.value.decode()
        elif cmd[0] == "fork":
            # a forked child (e.g. a worker of a server) feeds one buffer and exits normally
            r, w = os.pipe()
            t = time.monotonic()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                b = R.make_buffer(int(cmd[2]), seed=int(cmd[1]))
                lib.ridgeline_test_buffer_completed(b.data, len(b.data))
                until = time.monotonic() + 30
                while not lib.ridgeline_test_pool_idle() and time.monotonic() < until:
                    time.sleep(0.005)
                arr = (ctypes.c_uint64 * len(COUNTERS))()
                lib.ridgeline_test_counters(arr, len(COUNTERS))
                os.write(w, json.dumps({COUNTERS[i]: int(arr[i]) for i in range(len(COUNTERS))}).encode())
                os.close(w)
                sys.stdout.flush()
                os._exit(0) if len(cmd) > 3 else sys.exit(0)   # sys.exit runs the atexit handlers
            os.close(w)
            data = b""
            while chunk := os.read(r, 65536):
                data += chunk
            # The child closed the pipe right before exiting: from here on only its exit
            # runs (atexit handlers, inherited locks). Bounded, so a hang fails the test
            # instead of holding the suite: status None, the child killed.
            exiting = time.monotonic()
            status = None
            while time.monotonic() < exiting + 60:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = st
                    break
                time.sleep(0.005)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            out = {"child": json.loads(data or b"{}"), "status": status, "child_s": time.monotonic() - t,
                   "exit_s": time.monotonic() - exiting}
        elif cmd[0] == "quit":
            lib.ridgeline_test_shutdown()
            print(json.dumps({"bye": True}), flush=True)
            return 0
        print(json.dumps(out), flush=True)
    lib.ridgeline_test_shutdown()
    return 0


def stub_main(lib_path: str, stub_path: str) -> int:
    if os.environ.get("STUB_APP_OWN_SIGTERM"):
        def own(signum, frame):
            print(json.dumps({"own_handler": True}), flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, own)
    lib = ctypes.CDLL(lib_path)
    init_rc = lib.InitializeInjection()
    stub = ctypes.CDLL(stub_path)          # the very object the library dlopen'ed
    stub.stub_record.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    stub.stub_log.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    stub.stub_deliver.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.ridgeline_test_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
    stub.stub_record_timed.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
    # libkineto's calls (probes/native/tests/kineto_replay.c), linked against the stub as
    # libtorch is against libcupti: with the library preloaded, its calls reach ours first
    replay = ctypes.CDLL(os.environ["STUB_KINETO_REPLAY"]) if os.environ.get("STUB_KINETO_REPLAY") else None
    keep: list = []
    emitted: dict[int, float] = {}
    emitter: list[threading.Thread] = []

    def kernel(corr: int) -> bytes:
        b = R.make_buffer(1, seed=corr, corr0=corr, with_markers=False)
        keep.append(b)
        return b.kernels.tobytes()

    def emit(n: int, rate: float, corr0: int) -> None:
        for i in range(n):
            rec = kernel(corr0 + i)
            stub.stub_record(rec, len(rec))
            emitted[corr0 + i] = time.monotonic()
            if rate:
                time.sleep(1 / rate)

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        out: dict = {"init": init_rc}
        if cmd[0] == "emit":
            n, rate, corr0 = int(cmd[1]), float(cmd[2]), int(cmd[3])
            if rate:
                t = threading.Thread(target=emit, args=(n, rate, corr0))
                t.start()
                emitter.append(t)
            else:
                emit(n, 0, corr0)
        elif cmd[0] == "emitted":
            for t in emitter:
                t.join()
            out["emitted"] = emitted
        elif cmd[0] == "deliverspec":
            data, strings = _spec_buffer(json.loads(line.split(None, 1)[1]))
            keep.append(strings)
            out["rc"] = stub.stub_deliver(data, len(data))
        elif cmd[0] == "hold":
            stub.stub_hold(int(cmd[1]))
        elif cmd[0] == "emit_timed":           # N kernels of DUR_US each, stamped by CUPTI's source
            n, dur_us, corr0 = int(cmd[1]), int(cmd[2]), int(cmd[3])
            for i in range(n):
                rec = bytearray(kernel(corr0 + i))
                stub.stub_record_timed(bytes(rec), len(rec), dur_us * 1000)
            lo, hi = ctypes.c_int64(), ctypes.c_int64()
            stub.stub_last_timed_span(ctypes.byref(lo), ctypes.byref(hi))
            out["wall_ns"] = time.time_ns()
            out["span_ns"] = [lo.value, hi.value]    # what really passed (the last kernel)
        elif cmd[0] == "k_configure":
            out["rc"] = replay.kineto_configure(int(cmd[1]))
        elif cmd[0] == "k_stop":
            replay.kineto_stop()
        elif cmd[0] == "k_process":
            out["records"] = replay.kineto_process()
            cap = 1 << 16
            corr, st, en = (ctypes.c_uint32 * cap)(), (ctypes.c_uint64 * cap)(), (ctypes.c_uint64 * cap)()
            n = replay.kineto_kernels(corr, st, en, cap)
            out["kernels"] = [[int(corr[i]), int(st[i]), int(en[i])] for i in range(n)]
        elif cmd[0] == "k_reset":
            replay.kineto_reset()
        elif cmd[0] == "k_stats":
            out["unknown"] = replay.kineto_unknown_buffers()
            out["outstanding"] = replay.kineto_outstanding()
        elif cmd[0] == "kineto_start":
            out["rc"] = stub.stub_kineto_start()
        elif cmd[0] == "kineto_stop":
            out["leaked"] = stub.stub_kineto_stop(int(cmd[1]))
        elif cmd[0] == "log":
            buf = ctypes.create_string_buffer(1 << 16)
            stub.stub_log(buf, 1 << 16)
            out["log"] = buf.value.decode().splitlines()
        elif cmd[0] == "counters":
            arr = (ctypes.c_uint64 * len(COUNTERS))()
            n = lib.ridgeline_test_counters(arr, len(COUNTERS))
            out.update({COUNTERS[i]: int(arr[i]) for i in range(n)})
        elif cmd[0] == "tid":
            out["tid"] = threading.get_native_id()
        elif cmd[0] == "sigterm":
            print(json.dumps(out), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
            out = {"alive": True}
        elif cmd[0] == "quit":
            print(json.dumps({"bye": True}), flush=True)
            break
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--stub":
        sys.exit(stub_main(sys.argv[2], sys.argv[3]))
    sys.exit(main())
