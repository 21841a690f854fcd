"""The masking rule (pipeline/redact.py) on the characters the URL grammar allows in a user
name, password or query value, on a query quoted without its URL, and on an error's text that
holds a secret no URL grammar shows (issue 45, item 1)."""

from __future__ import annotations

import pytest

from pipeline.redact import mask

# sub-delims and a percent-encoding, each inside a secret
CHARS = ["'", "!", "$", "&", "(", ")", "*", "+", ",", ";", "=", "%41", "''"]


@pytest.mark.parametrize("c", CHARS)
def test_a_password_of_any_userinfo_character_is_masked(c):
    url = f"https://alice:se{c}cret@h.example/x"
    assert mask(url) == "https://alice:***@h.example/x"
    assert mask(f"run --set dataset.url={url} --only download") == (
        "run --set dataset.url=https://alice:***@h.example/x --only download"
    )
    assert mask(f"url: '{url}'") == "url: 'https://alice:***@h.example/x'"  # the quotes stay
    assert mask(f"https://se{c}cret@h.example/x") == "https://***@h.example/x"


@pytest.mark.parametrize("c", [c for c in CHARS if c not in ("&", "=")])
def test_a_query_value_of_any_character_is_masked(c):
    url = f"https://h.example/x?v=1&token=se{c}cret&page=2"
    assert mask(url) == "https://h.example/x?v=1&token=***&page=2"
    assert mask(f"({url}).") == "(https://h.example/x?v=1&token=***&page=2)."
    assert mask(f"https://h.example/x#access_token=se{c}cret") == (
        "https://h.example/x#access_token=***"
    )


def test_a_query_without_its_url_is_masked():
    # urllib3's and http.client's words about a request: the path and query, no scheme
    said = "Max retries exceeded with url: /api/2.0/runs?x=1&access_token=se'cret (Caused by"
    assert (
        mask(said) == "Max retries exceeded with url: /api/2.0/runs?x=1&access_token=*** (Caused by"
    )
    assert mask("'/data.txt?sig=abc;d' (found at least ' ')") == (
        "'/data.txt?sig=***' (found at least ' ')"
    )
    assert mask("see ?page=2 and x=1") == "see ?page=2 and x=1"


def test_an_errors_text_loses_every_secret_value_of_the_url_it_is_about():
    from pipeline.redact import scrub, secrets_of

    url = "http://h/data.txt?token=Bearer se cret&v=1"
    said = "URL can't contain control characters. '/data.txt?token=Bearer se cret&v=1' (found"
    assert scrub(said, url) == (
        "URL can't contain control characters. '/data.txt?token=***&v=1' (found"
    )
    assert set(secrets_of("http://u:p%27w@h/x?api_key=a+b")) >= {"p%27w", "p'w", "a+b", "a b"}
    assert secrets_of("http://h/x?token=${env:TOK}") == []  # a placeholder is no secret
