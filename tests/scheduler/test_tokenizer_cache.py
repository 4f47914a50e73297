"""A GGUF file's tokenizer is rebuilt by transformers once and then loaded from the cache
folder: the cached one encodes, decodes and renders chats exactly as the rebuilt one, an entry
follows the file (a changed file gets a new one), and an unwritable cache only costs time."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from batchwire.common.model_files import default_model_path

from scheduler_svc.core import tokenizer as tokenizer_module
from scheduler_svc.core.tokenizer import load_tokenizer

TEXTS = ["Hello, world!", "  spaces\tand\nnewlines ", "unicode: héllo 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>", "12345 + 678 = 13023"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def entries(cache) -> list[str]:
    folder = cache / "tokenizers"
    return sorted(os.listdir(folder)) if folder.exists() else []


def same(a, b) -> None:
    for text in TEXTS:
        ids = a(text).input_ids
        assert b(text).input_ids == ids, text
        assert b.decode(ids) == a.decode(ids)
        assert b.decode(ids, skip_special_tokens=True) == a.decode(ids, skip_special_tokens=True)
    assert (b.bos_token_id, b.eos_token_id, len(b)) == (a.bos_token_id, a.eos_token_id, len(a))
    assert b.chat_template == a.chat_template
    assert (b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))


def test_the_cached_tokenizer_is_the_rebuilt_one(tmp_path, monkeypatch, default_tokenizer):
    cache = tmp_path / "cache"
    monkeypatch.setenv("BATCHWIRE_CACHE_DIR", str(cache))
    rebuilt = load_tokenizer(None)
    [entry] = entries(cache)
    saved = cache / "tokenizers" / entry / "tokenizer.json"
    assert json.loads(saved.read_text())["model"]["vocab"]
    cached = load_tokenizer(None)
    assert entries(cache) == [entry]  # read, not written again
    same(rebuilt, cached)
    same(default_tokenizer, cached)

    # A damaged entry is rebuilt, not served.
    saved.write_text("{not json")
    same(rebuilt, load_tokenizer(None))
    assert entries(cache) == [entry] and json.loads(saved.read_text())["model"]["vocab"]


def test_the_key_follows_the_file(tmp_path):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), copy)
    first = tokenizer_module._cache_key(str(copy))
    assert first != tokenizer_module._cache_key(default_model_path())  # another path
    os.utime(copy, ns=(0, 0))
    assert tokenizer_module._cache_key(str(copy)) != first  # the file changed


def test_an_unwritable_cache_is_skipped(tmp_path, default_tokenizer):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    tokenizer_module._save(default_tokenizer, str(blocker / "cache" / "tokenizers" / "k"))
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("env, expected", [
    ({"BATCHWIRE_CACHE_DIR": "/x/bw"}, "/x/bw"),
    ({"XDG_CACHE_HOME": "/x/xdg"}, "/x/xdg/batchwire"),
    ({"HOME": "/x/home"}, "/x/home/.cache/batchwire"),
])
def test_the_cache_folder(monkeypatch, env, expected):
    for key in ("BATCHWIRE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert tokenizer_module.cache_root() == expected
