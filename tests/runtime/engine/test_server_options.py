"""What configures the replica server: `inferops serve` options and the checkpoint's
generation_config.json."""

from __future__ import annotations

import json

import pytest

from runtime.engine.config import GenerationDefaults
from tests.runtime.engine.replica_http import make_client, parse_serve_args, wait_ready


def test_generation_config_fills_in_what_a_request_leaves_out(engine, seen_params):
    # Qwen2.5's file, as shipped.
    defaults = GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05,
                                  repetition_penalty=1.05)
    test_client, _ = make_client(lambda: engine, generation_defaults=defaults)
    with test_client:
        wait_ready(test_client)
        test_client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        test_client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "b"}], "max_tokens": 1,
            "temperature": 0, "top_k": -1, "repetition_penalty": 1.0})
    first, second = seen_params
    assert (first.temperature, first.top_p, first.top_k, first.repetition_penalty) == (
        0.7, 0.8, 20, 1.05)
    assert (first.min_p, second.min_p) == (0.05, 0.05)
    assert (second.temperature, second.top_p, second.top_k, second.repetition_penalty) == (
        0.0, 0.8, 0, 1.0)


def test_generation_config_is_read_and_checked(tmp_path):
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults()  # no file: OpenAI's
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.05,
                                "presence_penalty": 0.5}))
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05,
        ignored=("presence_penalty",))
    path.write_text(json.dumps({"temperature": 0.6, "top_k": -1}))
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults(temperature=0.6)
    for bad, key in (({"top_p": 0}, "top_p"), ({"temperature": "hot"}, "temperature"),
                     ({"top_k": 2.5}, "top_k"), ({"top_k": float("inf")}, "top_k"),
                     ({"repetition_penalty": 0}, "repetition_penalty"),
                     ({"min_p": 1.5}, "min_p")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=key):
            GenerationDefaults.from_dir(tmp_path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        GenerationDefaults.from_dir(tmp_path)


def test_serve_refuses_an_unusable_generation_config_and_says_how_to_go_on(tmp_path, caplog):
    from project.cli import main

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "top_p" in caplog.text and "--no-generation-config" in caplog.text


def test_serve_options_become_settings(monkeypatch):
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", "from-env")
    args, settings = parse_serve_args(
        "--kv-cache-memory", "256MiB", "--max-body-bytes", "1MB",
        "--histogram-buckets-ttft", "0.05,0.1,1", "--fault-error-rate", "0.25")
    assert args.kv_cache_memory == 256 * 1024 ** 2 and settings.max_body_bytes == 1000 ** 2
    assert settings.histogram_buckets == {"ttft": (0.05, 0.1, 1.0)}
    assert settings.faults.fault_error_rate == 0.25
    assert settings.served_model_name == "tiny" and settings.admin_token == "from-env"


@pytest.mark.parametrize("argv", [
    ("--histogram-buckets-e2e", "1,0.5"), ("--fault-error-rate", "1.5"),
    ("--kv-cache-memory", "lots"), ("--fault-ttft-ms", "-1"),
])
def test_bad_serve_options_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_serve_args(*argv)
