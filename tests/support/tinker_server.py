"""The Tinker protocol (/api/v1) served in-process by a real uvicorn, over
tinker_double.py's FakeTraining (a TEST DOUBLE of TrainingService) and fake_engine.py's
FakeEngine: the real, unchanged tinker SDK talks to it by ``Server.client``. Two tenants'
keys are on file (team-b's as a digest); KEY_C is on none until a test writes it.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import tinker
import uvicorn
from loraplex_engine.server.app import create_app
from loraplex_engine.server.tinker.keys import KeyStore, digest

from tests.support.fake_engine import FakeEngine
from tests.support.tinker_clients import close_all, service_client
from tests.support.tinker_double import FakeTraining

KEY_A = "tml-aaaaaaaaaaaaaaaaaaaaaaaa"
KEY_B = "tml-bbbbbbbbbbbbbbbbbbbbbbbb"
KEY_C = "tml-cccccccccccccccccccccccc"
BASE = "tiny-base"


def tokenizer_dir(path: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world", *map(str, range(60))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    return str(path)


class Server:
    def __init__(self, tmp: Path, slots: int = 2, served_names: tuple[str, ...] = ()) -> None:
        self.keys_file = tmp / "keys"
        self.keys_file.write_text(f"team-a {KEY_A}\nteam-b sha256:{digest(KEY_B).hex()}\n")
        self.training = FakeTraining(BASE, tokenizer_dir(tmp / "tok"), slots=slots)
        keys = KeyStore(str(self.keys_file), recheck_s=0.0)
        app = create_app(
            FakeEngine(),
            "admin-token",
            tinker_keys=keys,
            training=lambda: self.training,
            served_names=served_names,
        )
        self.proto = app.state.tinker
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def client(self, key: str = KEY_A) -> tinker.ServiceClient:
        return service_client(self.url, key)

    def rest(self, key: str = KEY_A) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.url, api_key=key)

    def stop(self) -> None:
        close_all()  # the SDK clients while their server still answers
        self.server.should_exit = True
        self.thread.join(10)
        self.proto.close()
