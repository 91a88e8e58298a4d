"""Soak and chaos test of a whole `sluice serve`: every answer checked, nothing may go missing.

Starts a persistent embedded Redis and `sluice serve` on it, sends `--requests` inference
requests at `--concurrency` (each with its own id and one of a pool of random inputs whose
reference outputs are computed here with TorchScript), and meanwhile SIGKILLs a random
worker every `--kill-every` seconds and restarts Redis once, half way through. Every
response is classified:

* ok: 200, the request's id echoed, the output equal to the reference within 1e-4;
* clear error: a non-200 answer with a JSON `{"error": "..."}` body (counted by status and
  message);
* lost: no answer within `--timeout`, a broken connection, or a malformed body;
* duplicated/wrong: an id that was already answered or is another request's, or an output
  that is not the reference output of the request's own input.

Exits 1 when anything was lost, duplicated or wrong. Needs the test extras (aiohttp comes
with `tritonclient[http]`):

    .venv/bin/python benchmarks/soak.py --requests 10000 --concurrency 32 --workers 2 \\
        --kill-every 2.0 --model-repository examples/model_repository --model mlp
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from soak_processes import Serve, memory_snapshot  # noqa: E402
from soak_reference import ModelIO, Pool, model_file, reference_pool  # noqa: E402
from soak_report import summary  # noqa: E402
from soak_tally import Chaos, Tally  # noqa: E402

from sluice.embedded_redis import EmbeddedRedis  # noqa: E402

HEADER_LENGTH = "Inference-Header-Content-Length"
TOLERANCE = 1e-4
#: how often the Redis restarter checks whether the soak is half done.
RESTART_CHECK_S = 0.05
#: how often the soak prints its progress.
REPORT_EVERY_S = 5.0


# ---------------------------------------------------------------------------- requests


@dataclass
class Load:
    session: aiohttp.ClientSession
    url: str
    io: ModelIO
    pool: Pool
    encoding: str
    timeout: aiohttp.ClientTimeout
    tally: Tally
    ids: set[str]
    rng: random.Random


def encode_request(
    load: Load, request_id: str, row: int, binary: bool
) -> tuple[bytes, dict[str, str]]:
    x = load.pool.inputs[row]
    shape = [1, *x.shape]
    if not binary:
        body = {
            "id": request_id,
            "inputs": [
                {"name": load.io.input_name, "shape": shape, "datatype": "FP32", "data": x.tolist()}
            ],
        }
        return orjson.dumps(body), {"Content-Type": "application/json"}
    raw = x.tobytes()
    header = orjson.dumps(
        {
            "id": request_id,
            "inputs": [
                {
                    "name": load.io.input_name,
                    "shape": shape,
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": load.io.output_name, "parameters": {"binary_data": True}}],
        }
    )
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return header + raw, headers


class Malformed(Exception):
    pass


def decode_output(body: bytes, header_length: str | None, output_name: str) -> tuple[Any, Any]:
    """(id, output array) of a 200 answer; raises Malformed."""
    try:
        json_end = len(body) if header_length is None else int(header_length)
        header = orjson.loads(body[:json_end])
        binary = memoryview(body)[json_end:]
        (item,) = [o for o in header["outputs"] if o["name"] == output_name]
        if item["datatype"] != "FP32":
            raise Malformed(f"output datatype {item['datatype']}")
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            array = np.frombuffer(binary[:size], dtype=np.float32)
        else:
            array = np.asarray(item["data"], dtype=np.float32)
        return header.get("id"), array.reshape(item["shape"])
    except Malformed:
        raise
    except (ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
        raise Malformed(f"{type(exc).__name__}: {exc}") from None


def judge_ok(
    load: Load, request_id: str, row: int, body: bytes, header_length: str | None
) -> str | None:
    """Count a 200 answer as ok or wrong; returns why it is lost instead (malformed)."""
    tally = load.tally
    try:
        answered_id, output = decode_output(body, header_length, load.io.output_name)
    except Malformed as exc:
        return f"malformed 200 body ({str(exc)[:60]})"
    if answered_id != request_id:
        kind = "id of another request" if answered_id in load.ids else "id not echoed"
        tally.wrong[kind] += 1
        return None
    if answered_id in tally.answered:
        tally.wrong["id answered twice"] += 1
        return None
    tally.answered.add(answered_id)
    expected = load.pool.outputs[row]
    if output.shape[1:] == expected.shape and _close(output[0], expected):
        tally.ok += 1
        return None
    others = output.shape[1:] == expected.shape and any(
        _close(output[0], ref) for ref in load.pool.outputs
    )
    tally.wrong["output of another input" if others else "wrong output"] += 1
    return None


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.all(np.abs(a - b) <= TOLERANCE * (1 + np.abs(b))))


def judge_error(tally: Tally, status: int, body: bytes) -> str | None:
    """Count a clear error; returns why it is lost instead (no JSON error body)."""
    try:
        message = orjson.loads(body)["error"]
        if not isinstance(message, str):
            raise TypeError
    except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
        return f"HTTP {status} without a JSON error body"
    tally.clear[(status, message[:100])] += 1
    return None


async def one_request(load: Load, index: int) -> None:
    request_id = f"soak-{index}"
    load.ids.add(request_id)
    row = load.rng.randrange(len(load.pool.inputs))
    binary = load.encoding == "binary" or (load.encoding == "mixed" and index % 2 == 0)
    body, headers = encode_request(load, request_id, row, binary)
    load.tally.sent += 1
    started_s = time.monotonic()
    try:
        async with load.session.post(
            load.url, data=body, headers=headers, timeout=load.timeout
        ) as response:
            payload = await response.read()
            status = response.status
            header_length = response.headers.get(HEADER_LENGTH)
    except TimeoutError:
        load.tally.lose("no answer within the client timeout", request_id, started_s)
        return
    except aiohttp.ClientError as exc:
        load.tally.lose(f"connection error: {type(exc).__name__}", request_id, started_s)
        return
    load.tally.last_answer_s = time.monotonic()
    load.tally.latencies_s.append(load.tally.last_answer_s - started_s)
    if status == 200:
        why = judge_ok(load, request_id, row, payload, header_length)
    else:
        why = judge_error(load.tally, status, payload)
    if why is not None:
        load.tally.lose(why, request_id, started_s)


async def client(load: Load, counter: itertools.count, total: int) -> None:
    while (index := next(counter)) < total:
        await one_request(load, index)


# ---------------------------------------------------------------------------- chaos


async def killer(serve: Serve, every_s: float, chaos: Chaos, stop: asyncio.Event) -> None:
    rng = random.Random(1)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
            return
        pids = serve.worker_pids()
        if not pids:
            chaos.kill_misses += 1  # every worker is down and restarting
            continue
        victim = rng.choice(pids)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            chaos.kill_misses += 1
            continue
        chaos.kills += 1
        chaos.note(f"SIGKILL worker {victim}")


async def restarter(
    server: EmbeddedRedis,
    owner: concurrent.futures.Executor,
    tally: Tally,
    at: int,
    chaos: Chaos,
    stop: asyncio.Event,
) -> None:
    while tally.done < at and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RESTART_CHECK_S)
    if stop.is_set():
        return
    started_s = time.monotonic()
    chaos.note("Redis restart begins")
    await asyncio.get_running_loop().run_in_executor(owner, server.restart)
    chaos.redis_restart_s = time.monotonic() - started_s
    chaos.redis_restarts += 1
    chaos.note("Redis answers PING again")
    print(
        f"[soak] Redis restarted after {tally.done} answers ({chaos.redis_restart_s:.2f} s)",
        file=sys.stderr,
        flush=True,
    )


async def reporter(tally: Tally, chaos: Chaos, total: int, stop: asyncio.Event) -> None:
    started_s = time.monotonic()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), REPORT_EVERY_S)
        print(
            f"[soak] {time.monotonic() - started_s:6.1f}s answered {tally.done}/{total} ok "
            f"{tally.ok} errors {sum(tally.clear.values())} lost {sum(tally.lost.values())} "
            f"wrong {sum(tally.wrong.values())} kills {chaos.kills}",
            file=sys.stderr,
            flush=True,
        )


# ---------------------------------------------------------------------------- run


async def model_io(session: aiohttp.ClientSession, base: str, model: str) -> ModelIO:
    async with session.get(f"{base}/v2/models/{model}") as response:
        meta = await response.json()
    if response.status != 200:
        raise SystemExit(f"model metadata: HTTP {response.status} {meta}")
    if len(meta["inputs"]) != 1 or meta["inputs"][0]["datatype"] != "FP32":
        raise SystemExit("the soak needs a model with one FP32 input")
    shape = meta["inputs"][0]["shape"]
    return ModelIO(meta["inputs"][0]["name"], meta["outputs"][0]["name"], tuple(shape[1:]))


async def run_load(
    args: argparse.Namespace,
    serve: Serve,
    server: EmbeddedRedis,
    owner: concurrent.futures.Executor,
    report: dict[str, Any],
) -> tuple[Tally, Chaos, float]:
    connector = aiohttp.TCPConnector(limit=args.concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        io = await model_io(session, serve.url, args.model)
        path = model_file(args.model_repository, args.model)
        pool = await asyncio.to_thread(reference_pool, path, io.row_shape, args.pool, args.seed)
        tally, chaos = Tally(), Chaos()
        load = Load(
            session,
            f"{serve.url}/v2/models/{args.model}/infer",
            io,
            pool,
            args.encoding,
            aiohttp.ClientTimeout(total=args.timeout_s),
            tally,
            set(),
            random.Random(args.seed),
        )
        warm = min(args.warmup, args.requests)
        counter = itertools.count()
        await asyncio.gather(*(client(load, counter, warm) for _ in range(args.concurrency)))
        report["warm"] = memory_snapshot(serve, server.url)
        counter = itertools.count(warm)
        stop = asyncio.Event()
        side = [asyncio.create_task(reporter(tally, chaos, args.requests, stop))]
        if not args.no_chaos and args.kill_every_s > 0:
            side.append(asyncio.create_task(killer(serve, args.kill_every_s, chaos, stop)))
        if not args.no_chaos and not args.no_redis_restart:
            middle = args.requests // 2
            side.append(asyncio.create_task(restarter(server, owner, tally, middle, chaos, stop)))
        started_s = tally.t0_s = chaos.t0_s = time.monotonic()
        try:
            await asyncio.gather(
                *(client(load, counter, args.requests) for _ in range(args.concurrency))
            )
        finally:
            elapsed_s = time.monotonic() - started_s
            stop.set()
            await asyncio.gather(*side, return_exceptions=True)
        report["end"] = memory_snapshot(serve, server.url)
        return tally, chaos, elapsed_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--kill-every",
        dest="kill_every_s",
        type=float,
        default=2.0,
        help="SIGKILL a worker this often (0: never)",
    )
    parser.add_argument("--no-chaos", action="store_true", help="no kills, no Redis restart")
    parser.add_argument("--no-redis-restart", action="store_true")
    parser.add_argument(
        "--model-repository", type=Path, default=ROOT / "examples" / "model_repository"
    )
    parser.add_argument("--model", default="mlp")
    parser.add_argument(
        "--encoding", choices=("binary", "json", "mixed"), default="mixed", help="request bodies"
    )
    parser.add_argument("--pool", type=int, default=64, help="distinct inputs")
    parser.add_argument("--warmup", type=int, default=200, help="requests before chaos starts")
    parser.add_argument(
        "--timeout", dest="timeout_s", type=float, default=120.0, help="per-request client timeout"
    )
    parser.add_argument(
        "--server-request-timeout",
        dest="server_request_timeout_s",
        type=float,
        default=None,
        help="serve --request-timeout-s",
    )
    parser.add_argument("--http-port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--ready-timeout", dest="ready_timeout_s", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-file", type=Path, default=None, help="write serve's output here")
    args = parser.parse_args(argv)
    args.model_repository = args.model_repository.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    owner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="redis-owner")
    # start, restart and stop Redis from one long-lived thread: its death signal follows it
    server = owner.submit(EmbeddedRedis(persistent=True).start).result()
    serve: Serve | None = None
    report: dict[str, Any] = {}
    try:
        print(f"[soak] Redis at {server.url}; starting sluice serve", file=sys.stderr, flush=True)
        serve = Serve(args, server.url)
        serve.wait_ready(args.ready_timeout_s)
        print(f"[soak] ready; workers {serve.worker_pids()}", file=sys.stderr, flush=True)
        tally, chaos, elapsed_s = asyncio.run(run_load(args, serve, server, owner, report))
    finally:
        if serve is not None:
            code = serve.stop()
            print(f"[soak] sluice serve exited with {code}", file=sys.stderr, flush=True)
            if args.log_file is not None:
                args.log_file.write_text("\n".join(serve.log) + "\n")
        owner.submit(server.stop).result()
        owner.shutdown()
    assert serve is not None
    lines = summary(args, tally, chaos, elapsed_s, report, serve)
    bad = sum(tally.lost.values()) + sum(tally.wrong.values())
    if bad:
        noteworthy = [line for line in serve.log if "ERROR" in line or "WARNING" in line]
        lines += ["serve warnings/errors (last 15):", *("  " + n for n in noteworthy[-15:])]
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
