"""Documents made of text that ships with Python itself. Standard library only.

Run as a script in a clean interpreter (`python -I -S python_text.py`), it prints one
JSON line `[pile_set_name, text]` per document. `corpus.python_corpus_records` runs it
that way because what a module exposes can depend on what else the process imported
(libraries patch the standard library); a fresh interpreter with no site hooks gives
the same documents on every run of one Python install, and keeps the import side
effects of walking the standard library out of the caller's process.

Sources, in order:
  pydoc_topics       the language reference topics behind `help()` (pydoc_data.topics)
  stdlib_docstrings  docstrings of standard-library modules, classes, functions, methods
  stdlib_source      the standard library's .py files (opt-in)

`--order hashed` emits the same documents sorted by a hash of their text instead of by
source: Megatron splits a dataset into train/valid/test by contiguous document ranges,
so in source order the validation split would be the last standard-library files alone;
hashed order mixes prose and code into every split, deterministically.
"""
import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import sysconfig
import warnings

PYTHON_SOURCES = ("pydoc_topics", "stdlib_docstrings", "stdlib_source")
DEFAULT_PYTHON_SOURCES = ("pydoc_topics", "stdlib_docstrings")
DOCUMENT_ORDERS = ("source", "hashed")

# Modules whose import has side effects (opens a browser, prints, touches the terminal,
# needs a display) or that are platform stubs, tests, or deprecated shims.
_SKIP_MODULES = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
    "distutils", "pydoc_data", "readline", "msilib", "winreg", "winsound", "msvcrt", "nt",
    "test", "tests", "site", "sitecustomize", "usercustomize", "xxlimited", "xxlimited_35",
    "xxsubtype", "xxmodule",
})
# Packages whose submodules are codec tables, not prose.
_NO_SUBMODULES = frozenset({"encodings"})


def _stdlib_dirs():
    stdlib = sysconfig.get_paths()["stdlib"]
    dynload = os.path.join(stdlib, "lib-dynload")
    return [stdlib] + ([dynload] if os.path.isdir(dynload) else [])


def _skip(name):
    return any(part.startswith("_") or part in _SKIP_MODULES for part in name.split("."))


def _import_quietly(name):
    """Import a module with warnings and output silenced; None when it cannot be imported."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except KeyboardInterrupt:
            raise
        except BaseException:  # ImportError, platform errors, SystemExit from scripts
            return None


def _walk_module(name):
    if _skip(name):
        return
    module = _import_quietly(name)
    if module is None:
        return
    yield module
    if hasattr(module, "__path__") and name not in _NO_SUBMODULES:
        for info in sorted(pkgutil.iter_modules(module.__path__, name + "."), key=lambda m: m.name):
            yield from _walk_module(info.name)


def stdlib_modules():
    """Importable standard-library modules in sorted order, each package before its submodules."""
    top = {m.name for m in pkgutil.iter_modules(_stdlib_dirs())} | set(sys.builtin_module_names)
    for name in sorted(top):
        yield from _walk_module(name)


def _own_doc(obj):
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def module_docstrings(module):
    """(qualified name, docstring) for the module, its public classes/functions and methods.

    Only objects defined in this module, only their own docstrings (no inheritance), in
    sorted order. No signatures: default values' reprs can hold memory addresses.
    """
    name = module.__name__
    doc = _own_doc(module)
    if doc:
        yield name, doc
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        doc = _own_doc(obj)
        if doc:
            yield f"{name}.{attr}", doc
        if inspect.isclass(obj):
            for member, value in sorted(vars(obj).items()):
                if member.startswith("_"):
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if not (inspect.isroutine(value) or isinstance(value, property)):
                    continue
                doc = _own_doc(value)
                if doc:
                    yield f"{name}.{attr}.{member}", doc


def check_sources(sources):
    unknown = set(sources) - set(PYTHON_SOURCES)
    if unknown:
        raise ValueError(f"unknown corpus source(s) {sorted(unknown)}; choose from {PYTHON_SOURCES}")


def python_documents(sources=DEFAULT_PYTHON_SOURCES, min_chars=32):
    """(pile_set_name, text) for each document, in a fixed order."""
    check_sources(sources)
    if "pydoc_topics" in sources:
        from pydoc_data.topics import topics

        for topic in sorted(topics):
            if len(topics[topic].strip()) >= min_chars:
                yield "pydoc_topics", topics[topic]
    if "stdlib_docstrings" in sources:
        seen = set()
        for module in stdlib_modules():
            for qualname, doc in module_docstrings(module):
                if len(doc) < min_chars or doc in seen:  # aliases and re-exports repeat docs
                    continue
                seen.add(doc)
                yield "stdlib_docstrings", f"{qualname}\n\n{doc}\n"
    if "stdlib_source" in sources:
        stdlib = _stdlib_dirs()[0]
        for root, dirs, files in os.walk(stdlib):
            dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__")
                             and not d.startswith("config-") and not _skip(d))
            for fname in sorted(f for f in files if f.endswith(".py")):
                try:
                    with open(os.path.join(root, fname), encoding="utf-8") as f:
                        text = f.read()
                except (UnicodeDecodeError, OSError):
                    continue
                if len(text.strip()) >= min_chars:
                    yield "stdlib_source", text


def ordered_documents(documents, order="source"):
    """`documents` as they come ("source"), or sorted by the SHA-1 of their text ("hashed")."""
    if order == "source":
        return documents
    if order == "hashed":
        return sorted(documents, key=lambda doc: hashlib.sha1(doc[1].encode("utf-8")).digest())
    raise ValueError(f"unknown document order {order!r}; choose from {DOCUMENT_ORDERS}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sources", nargs="+", default=list(DEFAULT_PYTHON_SOURCES), choices=PYTHON_SOURCES)
    parser.add_argument("--min-chars", type=int, default=32)
    parser.add_argument("--order", default="source", choices=DOCUMENT_ORDERS)
    args = parser.parse_args()
    out = io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8", newline="\n", write_through=False)
    for subset, text in ordered_documents(python_documents(args.sources, args.min_chars), args.order):
        out.write(json.dumps([subset, text], ensure_ascii=False) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
