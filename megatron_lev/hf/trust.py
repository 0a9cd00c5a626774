"""Which Hugging Face folders may run their own Python code (`trust_remote_code`).

A LEV export ships its model code (REMOTE_CODE_FILES, registered in config.json's `auto_map`).
`hf_trust_remote_code` trusts it only when every file is byte-identical (SHA-256) to the copy
this package ships; anything else is refused naming the file, unless the user passed
--trust-remote-code. Plain transformers classes need no trust at all.
"""
from __future__ import annotations

import hashlib
import json
import os

HF_DIR = os.path.dirname(os.path.abspath(__file__))
LEV_SOURCE = os.path.join(os.path.dirname(HF_DIR), "lev", "generator.py")  # exported as lev.py
LEV_CONFIG_SOURCE = os.path.join(os.path.dirname(HF_DIR), "lev", "lev_config.py")  # which lev.py imports
REMOTE_CODE_FILES = {  # file written into the export -> its source in this package
    "configuration_lev.py": os.path.join(HF_DIR, "configuration_lev.py"),
    "modeling_lev.py": os.path.join(HF_DIR, "modeling_lev.py"),
    "lev.py": LEV_SOURCE,
    "lev_config.py": LEV_CONFIG_SOURCE,
}
LEV_AUTO_MAP = {"AutoConfig": "configuration_lev.LevConfig", "AutoModel": "modeling_lev.LevModel",
                "AutoModelForCausalLM": "modeling_lev.LevForCausalLM"}


class UntrustedCodeError(ValueError):
    """A Hugging Face folder whose Python code is not byte-identical to ours."""


def _sha256(path: str) -> str:
    with open(path, "rb") as f:  # source files: small
        return hashlib.sha256(f.read()).hexdigest()


def hf_trust_remote_code(folder: str, trust_remote_code: bool = False) -> bool:
    """The `trust_remote_code` to load a Hugging Face folder with (model, config or tokenizer).

    * no `auto_map` in config.json / tokenizer_config.json: False (a plain transformers
      class such as LlamaForCausalLM; nothing of the folder runs);
    * `trust_remote_code` (the user's --trust-remote-code): True, the folder's code as it is;
    * a LEV export: True only when its auto_map names our classes and each code file
      (modeling_lev.py, configuration_lev.py, lev.py, lev_config.py) is byte-identical (SHA-256) to the copy
      this package ships; otherwise UntrustedCodeError naming the file, before any of it runs.
    """
    auto_maps = {}
    for name in ("config.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    auto_map = json.load(f).get("auto_map")
            except (OSError, ValueError, AttributeError) as exc:
                raise ValueError(f"{path}: not a JSON object ({exc})") from None
            if auto_map:
                auto_maps[path] = auto_map
    if not auto_maps:
        return False
    if trust_remote_code:
        return True
    override = "pass --trust-remote-code to run this folder's code anyway (only if you have read it)"
    ours = set(LEV_AUTO_MAP.values())
    for path, auto_map in auto_maps.items():
        values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
        foreign = [v for v in values if v not in ours]
        if foreign:
            raise UntrustedCodeError(f"{path}: auto_map names {foreign[0]!r}, which is not megatron_lev's LEV code: "
                                     f"refusing to run it; {override}")
    for name, source in REMOTE_CODE_FILES.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise UntrustedCodeError(f"{path}: missing (a LEV export ships {', '.join(REMOTE_CODE_FILES)}); {override}")
        if _sha256(path) != _sha256(source):
            raise UntrustedCodeError(f"{path}: differs from the copy this megatron_lev ships ({source}, SHA-256): "
                                     f"refusing to run it; {override}")
    return True
