"""Secrets stay out of logs, config dumps and tool error texts: config-key masking and URL passwords."""

import asyncio
import logging
import os
import socket
import subprocess
import sys

import pytest

from megatron_arpo.redaction import REDACTED, install_log_redaction, redact, redact_url
from megatron_arpo.tools.base import ToolExecutor, format_tool_error
from megatron_arpo.tools.search import HttpRetrieverBackend, SearchTool


@pytest.mark.parametrize("text, expected", [
    ("http://user:hunter2@host:8000/retrieve", "http://user:***@host:8000/retrieve"),
    ("see https://user:p@ss@host/x now", "see https://user:***@host/x now"),  # an unencoded '@' in the password
    ("postgres://u:s3cret@db.example.com", "postgres://u:***@db.example.com"),
    ("http://:token@host", "http://:***@host"),
    ("a http://a:b@c:1?q=1 and 'http://d:e@f/g'", "a http://a:***@c:1?q=1 and 'http://d:***@f/g'"),
    ("http://u:p@h#frag", "http://u:***@h#frag"),
    # nothing to hide: no password, or no URL
    ("retriever http://host:8000/retrieve unreachable", "retriever http://host:8000/retrieve unreachable"),
    ("ssh://git@github.com:22/x", "ssh://git@github.com:22/x"),
    ("mailto:a@b.c and http://host/path@x", "mailto:a@b.c and http://host/path@x"),
    # issue 29: a token as the user name, secret query parameters, a raw '/' in a password
    ("https://ghp_abcdefghijklmnop1234@github.com/o/r.git", "https://***@github.com/o/r.git"),
    ("https://hf_Ab12cd34@huggingface.co/x", "https://***@huggingface.co/x"),
    ("http://h:8/r?api_key=S3CRET&q=1", "http://h:8/r?api_key=***&q=1"),
    ("http://h/r?q=1&token=T0K&key=K3Y#f", "http://h/r?q=1&token=***&key=***#f"),
    ("'http://h/r?access_token=abc' failed", "'http://h/r?access_token=***' failed"),
    ("http://u:pa/ss@host:8000/retrieve", "http://u:***@host:8000/retrieve"),
    ("http://host:8000/a?email=x@y.com&page=2", "http://host:8000/a?email=x@y.com&page=2"),
])
def test_redact_url(text, expected):
    assert redact_url(text) == expected


def test_redact_masks_secret_keys_and_url_passwords_in_values():
    data = {"api_key": "abc", "api_key_env": "MY_KEY", "tools": {"search": {"url": "http://u:pw@h/retrieve"}},
            "list": ["https://x:y@z", 3], "tokenizer": "Qwen/Qwen3"}
    out = redact(data)
    assert out == {"api_key": REDACTED, "api_key_env": "MY_KEY", "tools": {"search": {"url": "http://u:***@h/retrieve"}},
                   "list": ["https://x:***@z", 3], "tokenizer": "Qwen/Qwen3"}
    assert data["tools"]["search"]["url"] == "http://u:pw@h/retrieve"  # a copy; the input is untouched


def test_log_handlers_never_print_url_passwords(capsys):
    logger = logging.getLogger("test_redaction_logs")
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        install_log_redaction()
        install_log_redaction()  # idempotent
        assert sum(type(f).__name__ == "RedactUrlPasswords" for f in handler.filters) == 1
        logger.warning("retriever %s failed", "http://u:topsecret@h:1/r")
        try:
            raise ConnectionError("cannot reach http://u:topsecret@h:1/r")
        except ConnectionError:
            logger.exception("with a traceback")
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    assert "topsecret" not in err
    assert "retriever http://u:***@h:1/r failed" in err and "ConnectionError: cannot reach http://u:***@h:1/r" in err


def test_tool_error_texts_never_carry_url_passwords():
    assert format_tool_error("search", "http://u:pw@h/x said 500") == "Error: search tool: http://u:***@h/x said 500"
    with socket.socket() as probe:  # a port with nothing listening: connection refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = HttpRetrieverBackend(f"http://alice:pw-123@127.0.0.1:{port}/retrieve", timeout_s=2)
    executor = ToolExecutor([SearchTool(backend)], retries=1, backoff_s=0.01)

    async def call():
        try:
            return await executor.execute("search", "q")
        finally:
            await executor.close()

    result = asyncio.run(call())
    assert result.error == "transport"
    assert "pw-123" not in result.text and "alice:***@127.0.0.1" in result.text
    with pytest.raises(ValueError) as info:
        HttpRetrieverBackend("ftp://alice:pw-123@host/x")
    assert "pw-123" not in str(info.value)


def test_config_show_redacts_url_passwords():
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                        "demo.yaml")
    shown = subprocess.run([sys.executable, "-m", "megatron_arpo", "config", "show", "--config", demo,
                            "--set", "tools.search.backend=http", "--set", "tools.search.url=http://bob:pw-456@h:8/r"],
                           capture_output=True, text=True, check=True).stdout
    assert "pw-456" not in shown and "http://bob:***@h:8/r" in shown


CREDENTIAL_URLS = {"ghp_tok3nAsUserName123": "https://ghp_tok3nAsUserName123@h:8/r",
                   "qu3ry-k3y": "http://h:8/r?api_key=qu3ry-k3y",
                   "pa/ss-789": "http://bob:pa/ss-789@h:8/r"}


@pytest.mark.parametrize("secret", sorted(CREDENTIAL_URLS))
def test_config_show_and_tool_errors_mask_every_credential_form(secret, capsys):
    from megatron_arpo import cli

    url = CREDENTIAL_URLS[secret]
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                        "demo.yaml")
    assert cli.main(["config", "show", "--config", demo, "--set", "tools.search.backend=http",
                     "--set", f"tools.search.url={url}"]) == 0
    shown = capsys.readouterr().out
    assert secret not in shown and "***" in shown
    text = format_tool_error("search", f"retriever {url} answered HTTP 500")
    assert secret not in text and "***" in text
