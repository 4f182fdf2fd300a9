"""A test-only stand-in for llm-d's decode-side routing sidecar (llm-d-inference-scheduler
`cmd/pd-sidecar`, `pkg/sidecar/proxy`: docs/envoy-extproc.md "llm-d's decode sidecar"), in front of
one simulated decode worker, for tests/deploy/test_envoy_picker_llmd.py. Not llm-d's code: the few
steps of its NIXL connector the picker's llm-d mode relies on, written from that description.

`python -m tests.deploy.llmd_sidecar --decode URL` serves on 127.0.0.1 (port 0 by default) and
prints `{"url": ...}` once listening (the tests' announcement contract, tests/deploy/processes.py).
1. A completion (`POST /v1/chat/completions` or `/v1/completions`): `x-prefiller-host-port` is read
   and removed (a comma list: the first entry). Absent: the request goes to D unchanged. Present:
   the P leg, a copy of the body with `kv_transfer_params` {do_remote_decode: true,
   do_remote_prefill: false, remote_*: null}, `stream` false, no `stream_options`, `max_tokens` (and
   `max_completion_tokens` when sent) 1, to `http://<that ip:port>` on the same path with one
   `x-request-id` for both legs; then D's leg, the original body with P's `kv_transfer_params`.
   A P answering 400-451 is the client's error (passed on); any other P failure: D alone.
2. `GET /health` is answered 200 by the sidecar itself, whatever D's state (as llm-d's does:
   `pkg/sidecar/proxy/proxy.go`, `createRoutes`); anything else goes to D as it is (/metrics,
   /v1/models), so the gateway scrapes D through it.
3. `GET /_sidecar/seen` lists the prefiller header of each completion (null when absent): what the
   test asserts the picker sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any, Final

import aiohttp
from aiohttp import web

from tests.support.nixl import prefill_kv_params

PREFILLER: Final = "x-prefiller-host-port"
_COMPLETIONS: Final = ("/v1/chat/completions", "/v1/completions")
_HOP: Final = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["kv_transfer_params"] = prefill_kv_params()
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


class Sidecar:
    def __init__(self, decode: str, session: aiohttp.ClientSession) -> None:
        self._decode = decode.rstrip("/")
        self._http = session
        self.seen: list[str | None] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/_sidecar/seen":
            return web.json_response(self.seen)
        if request.method == "GET" and request.path == "/health":
            return web.Response(status=200)
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in _HOP and k.lower() != PREFILLER
        }
        data = await request.read()
        if request.method == "POST" and request.path in _COMPLETIONS:
            raw = request.headers.get(PREFILLER)
            self.seen.append(raw)
            if raw:
                prefilled = await self._prefill(request.path, raw.split(",")[0].strip(), data, headers)
                if isinstance(prefilled, web.Response):
                    return prefilled
                data, headers = prefilled
        return await self._to_decode(request, data, headers)

    async def _prefill(
        self, path: str, prefiller: str, data: bytes, headers: dict[str, str]
    ) -> tuple[bytes, dict[str, str]] | web.Response:
        body = json.loads(data)
        headers = {**headers, "x-request-id": str(uuid.uuid4())}
        try:
            async with self._http.post(
                f"http://{prefiller}{path}", json=_prefill_body(body), headers=headers
            ) as reply:
                answer = await reply.read()
                if 400 <= reply.status <= 451:
                    return web.Response(status=reply.status, body=answer, content_type="application/json")
                reply.raise_for_status()
                params = json.loads(answer).get("kv_transfer_params")
        except (aiohttp.ClientError, ValueError):
            return data, headers  # D alone, as llm-d's sidecar falls back
        if params is not None:
            body["kv_transfer_params"] = params
        return json.dumps(body).encode(), headers

    async def _to_decode(
        self, request: web.Request, data: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        async with self._http.request(
            request.method, self._decode + request.path_qs, data=data or None, headers=headers
        ) as reply:
            response = web.StreamResponse(status=reply.status)
            for name, value in reply.headers.items():
                if name.lower() not in _HOP:
                    response.headers[name] = value
            await response.prepare(request)
            async for piece in reply.content.iter_any():
                await response.write(piece)
            await response.write_eof()
            return response


async def _serve(decode: str, port: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        sidecar = Sidecar(decode, session)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", sidecar.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        bound = runner.addresses[0][1]
        print(json.dumps({"url": f"http://127.0.0.1:{bound}"}), flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", required=True, help="the decode worker's URL")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(_serve(args.decode, args.port))


if __name__ == "__main__":
    main()
