"""How the replica server's HTTP tests reach it: in process, through Starlette's TestClient.

The `engine`, `tokenizer`, `seen_params` and `client` fixtures (conftest.py) run the real
`LLMEngine` on the tiny random Llama; these are the plain helpers the test files share.
"""

from __future__ import annotations

import argparse
import json

from starlette.testclient import TestClient

from runtime.engine.async_engine import AsyncEmbedder, AsyncEngine
from runtime.engine.server import ReplicaServer, ServerSettings, add_arguments, settings_from_args
from tests.waiting import wait_until

MODEL = "tiny"
MAX_MODEL_LEN = 64
GREEDY = {"temperature": 0, "ignore_eos": True}  # the same tokens every time, all of them


def make_client(load, **settings) -> tuple[TestClient, ReplicaServer]:
    replica = ReplicaServer(AsyncEngine(load),
                            ServerSettings(served_model_name=MODEL, model_root="/models/tiny",
                                           **settings))
    return TestClient(replica.build_app(), raise_server_exceptions=False), replica


def wait_ready(client: TestClient) -> None:
    wait_until(lambda: client.get("/health").status_code == 200, "the engine to become ready", interval=0.01)


def embedder_client(encoder) -> tuple[TestClient, ReplicaServer]:
    replica = ReplicaServer(AsyncEmbedder(lambda: encoder),
                            ServerSettings(served_model_name=MODEL, model_root="/m"))
    return TestClient(replica.build_app(), raise_server_exceptions=False), replica


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n")
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def parse_serve_args(*argv: str, model: str = "/models/tiny"):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", model, *argv])
    return args, settings_from_args(args)
