"""Renders the Helm chart without helm: a Go text/template + Sprig interpreter for the chart's subset."""

from __future__ import annotations

import base64
import copy
import json
import posixpath
import re
import secrets
import string
from collections import ChainMap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CHART = Path(__file__).resolve().parent.parent.parent / "helm" / "fleetprof"


class TemplateError(Exception):
    """The template uses a construct or function outside the subset, or fails as Helm would fail it."""


# ---- a Go text/template interpreter for the chart's subset -------------------------------------------

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<num>-?\d+(?:\.\d+)?)|(?P<punct>:=|=|[()|,])'
    r"|(?P<word>\$?[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*|\$(?:\.[A-Za-z_]\w*)*|\.(?:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)?))"
)


def _tokenize(src: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    src = src.strip()
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"cannot parse {src[pos:]!r} in {{{{ {src} }}}}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def parse(text: str) -> list:
    """Template text -> a tree: str, ("act", tokens), ("if", [(cond, body)], else), ("with"/"range", ...)."""
    pieces: list = []
    pos = 0
    for m in _ACTION.finditer(text):
        pieces.append(text[pos : m.start()])
        if m.group(1) and pieces[-1]:
            pieces[-1] = pieces[-1].rstrip(" \t\n")
        pieces.append(("raw", m.group(2).strip(), bool(m.group(3))))
        pos = m.end()
    pieces.append(text[pos:])
    # right trim markers eat the whitespace of the next text piece
    for i, p in enumerate(pieces):
        if isinstance(p, tuple) and p[2] and i + 1 < len(pieces) and isinstance(pieces[i + 1], str):
            pieces[i + 1] = pieces[i + 1].lstrip(" \t\n")
    root: list = []
    stack: list[tuple[list, Any]] = [(root, None)]
    for p in pieces:
        body = stack[-1][0]
        if isinstance(p, str):
            if p:
                body.append(p)
            continue
        src = p[1]
        if src.startswith("/*"):
            continue
        word = src.split(None, 1)[0] if src else ""
        rest = src[len(word) :].strip()
        if word in ("if", "with", "range"):
            node = [word, [(_tokenize(rest), [])], None]
            body.append(node)
            stack.append((node[1][0][1], node))
        elif word == "define":
            node = ["define", json.loads(rest), []]
            body.append(node)
            stack.append((node[2], node))
        elif word == "else":
            node = stack.pop()[1]
            if rest.startswith("if "):
                node[1].append((_tokenize(rest[3:]), []))
                stack.append((node[1][-1][1], node))
            else:
                node[2] = []
                stack.append((node[2], node))
        elif word == "end":
            stack.pop()
        else:
            body.append(("act", _tokenize(src)))
    if len(stack) != 1:
        raise TemplateError("unclosed block")
    return root


def _truthy(v: Any) -> bool:
    return not (v is None or v is False or v == 0 or v == "" or v == {} or v == [])


def _go_str(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (dict, list)):
        raise TemplateError(f"printing a {type(v).__name__} directly: use toYaml")
    return str(v)


def _printf(fmt: str, *args: Any) -> str:
    it = iter(args)

    def sub(m: re.Match) -> str:
        return '"' + _go_str(next(it)) + '"' if m.group(1) == "q" else _go_str(next(it))

    return re.sub(r"%([svdq])", sub, fmt)


def _to_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def _indent(n: int, s: str) -> str:
    return "\n".join(" " * n + line for line in s.split("\n"))


def _kind(v: Any) -> str:
    for t, name in ((bool, "bool"), (int, "int"), (float, "float64"), (str, "string"), (dict, "map")):
        if isinstance(v, t):
            return name
    return "slice" if isinstance(v, list) else "invalid"


def _required(msg: str, v: Any) -> Any:
    if not _truthy(v):
        raise TemplateError(msg)
    return v


def _and(*args: Any) -> Any:
    """Go's `and`: the first empty argument, else the last."""
    return next((a for a in args if not _truthy(a)), args[-1])


def _or(*args: Any) -> Any:
    """Go's `or`: the first non-empty argument, else the last."""
    return next((a for a in args if _truthy(a)), args[-1])


def _dict(*pairs: Any) -> dict:
    if len(pairs) % 2:
        raise TemplateError("dict takes key/value pairs")
    return {_go_str(pairs[i]): pairs[i + 1] for i in range(0, len(pairs), 2)}


def _get(d: Any, key: str) -> Any:
    if not isinstance(d, dict):
        raise TemplateError(f"get on a {type(d).__name__}, not a map")
    return d.get(key, "")


def _rand_alpha_num(n: int) -> str:
    """Sprig's randAlphaNum: crypto/rand letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(n))


def _b64dec(s: str) -> str:
    try:
        return base64.b64decode(s, validate=True).decode()
    except ValueError as err:
        raise TemplateError(f"b64dec {s!r}: {err}") from None


FUNCS: dict[str, Callable[..., Any]] = {
    "default": lambda d, v=None: v if _truthy(v) else d,
    "quote": lambda v: json.dumps(_go_str(v)),
    "trunc": lambda n, s: s[:n],
    "trimSuffix": lambda suf, s: s[: -len(suf)] if suf and s.endswith(suf) else s,
    "contains": lambda sub, s: sub in s,
    "printf": _printf,
    "toYaml": _to_yaml,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "indent": _indent,
    "not": lambda v: not _truthy(v),
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "dir": posixpath.dirname,
    "kindIs": lambda k, v: _kind(v) == k,
    "ternary": lambda a, b, cond: a if cond else b,
    "required": _required,
    "and": _and,
    "or": _or,
    "dict": _dict,
    "get": _get,
    "randAlphaNum": _rand_alpha_num,
    "b64enc": lambda s: base64.b64encode(_go_str(s).encode()).decode(),
    "b64dec": _b64dec,
    "replace": lambda old, new, s: s.replace(old, new),
}


class Renderer:
    """Renders parsed templates. `cluster` is what Helm's `lookup` sees: the objects already in the cluster
    (`helm upgrade`); empty, lookup finds nothing, as under `helm template`."""

    def __init__(self, defines: dict[str, list], cluster: Sequence[dict] = ()):
        self.defines = defines
        self.cluster = list(cluster)

    def lookup(self, api_version: str, kind: str, namespace: str, name: str) -> dict:
        """Helm's lookup: the object (a copy) or an empty map; an empty name lists the kind."""
        found = [
            o
            for o in self.cluster
            if o["apiVersion"] == api_version
            and o["kind"] == kind
            and (not namespace or o["metadata"].get("namespace") == namespace)
            and (not name or o["metadata"]["name"] == name)
        ]
        if not name:
            return {"apiVersion": api_version, "kind": f"{kind}List", "items": copy.deepcopy(found)}
        return copy.deepcopy(found[0]) if found else {}

    def render(self, nodes: list, dot: Any, scope: ChainMap | dict[str, Any]) -> str:
        if not isinstance(scope, ChainMap):
            scope = ChainMap(scope)
        out = []
        for n in nodes:
            if isinstance(n, str):
                out.append(n)
            elif isinstance(n, tuple):
                v = self.pipeline(n[1], dot, scope, declare=True)
                if v is not _DECLARED:
                    out.append(_go_str(v))
            elif n[0] == "define":
                continue
            elif n[0] == "if":
                for cond, body in n[1]:
                    if _truthy(self.pipeline(cond, dot, scope)):
                        out.append(self.render(body, dot, scope.new_child()))
                        break
                else:
                    if n[2] is not None:
                        out.append(self.render(n[2], dot, scope.new_child()))
            elif n[0] == "with":
                cond, body = n[1][0]
                v = self.pipeline(cond, dot, scope)
                if _truthy(v):
                    out.append(self.render(body, v, scope.new_child()))
                elif n[2] is not None:
                    out.append(self.render(n[2], dot, scope.new_child()))
            elif n[0] == "range":
                toks, body = n[1][0]
                names: list[str] = []
                if ("punct", ":=") in toks:
                    at = toks.index(("punct", ":="))
                    names = [t[1] for t in toks[:at] if t[0] == "word"]
                    toks = toks[at + 1 :]
                seq = self.pipeline(toks, dot, scope)
                items = sorted(seq.items()) if isinstance(seq, dict) else list(enumerate(seq or []))
                for k, v in items:
                    inner = scope.new_child()
                    if len(names) == 2:
                        inner[names[0]], inner[names[1]] = k, v
                    elif names:
                        inner[names[0]] = v
                    out.append(self.render(body, v, inner))
            else:
                raise TemplateError(f"unknown node {n[0]}")
        return "".join(out)

    def pipeline(self, toks: list, dot: Any, scope: ChainMap, declare: bool = False) -> Any:
        if len(toks) > 2 and toks[1] in (("punct", ":="), ("punct", "=")):
            if not declare:
                raise TemplateError("declaration inside an expression")
            name = toks[0][1]
            value = self.pipeline(toks[2:], dot, scope)
            if toks[1][1] == ":=":
                scope[name] = value  # declared in the innermost block
            else:
                # `=` assigns the variable where it was declared, which may be an enclosing block.
                owner = next((m for m in scope.maps if name in m), None)
                if owner is None:
                    raise TemplateError(f"undefined variable {name}")
                owner[name] = value
            return _DECLARED
        commands: list[list] = [[]]
        depth = 0
        for t in toks:
            if t == ("punct", "|") and depth == 0:
                commands.append([])
                continue
            depth += t == ("punct", "(")
            depth -= t == ("punct", ")")
            commands[-1].append(t)
        value: Any = _NOTHING
        for cmd in commands:
            value = self.command(cmd, dot, scope, value)
        return value

    def command(self, toks: list, dot: Any, scope: ChainMap, piped: Any) -> Any:
        operands: list = []
        i = 0
        while i < len(toks):
            kind, text = toks[i]
            if text == "(":
                depth, j = 1, i + 1
                while depth:
                    depth += toks[j][1] == "("
                    depth -= toks[j][1] == ")"
                    j += 1
                operands.append(("value", self.pipeline(toks[i + 1 : j - 1], dot, scope)))
                i = j
                continue
            operands.append((kind, text))
            i += 1
        head_kind, head = operands[0]
        args = [self.operand(k, t, dot, scope) for k, t in operands[1:]]
        if piped is not _NOTHING:
            args.append(piped)
        if head_kind == "word" and not head.startswith((".", "$")) and head not in ("true", "false", "nil"):
            if head == "include":
                return self.include(*args)
            if head == "lookup":
                return self.lookup(*args)
            if head not in FUNCS:
                raise TemplateError(f"function {head!r} is not in the supported subset")
            return FUNCS[head](*args)
        value = self.operand(head_kind, head, dot, scope)
        if callable(value):
            return value(*args)
        if args:
            raise TemplateError(f"{head} is not a function")
        return value

    def operand(self, kind: str, text: Any, dot: Any, scope: ChainMap) -> Any:
        if kind == "value":
            return text
        if kind == "str":
            return json.loads(text)
        if kind == "num":
            return float(text) if "." in text else int(text)
        if text in ("true", "false"):
            return text == "true"
        if text == "nil":
            return None
        if text in FUNCS:  # a function name as an argument is called without arguments (`default dict`)
            return FUNCS[text]()
        if text.startswith("$"):
            name, _, path = text.partition(".")
            if name not in scope:
                raise TemplateError(f"undefined variable {name}")
            base = scope[name]
        elif text.startswith("."):
            base, path = dot, text[1:]
        else:
            raise TemplateError(f"unexpected {text!r}")
        for part in path.split(".") if path else []:
            base = base.get(part) if isinstance(base, dict) else getattr(base, part, None)
        return base

    def include(self, name: str, ctx: Any) -> str:
        if name not in self.defines:
            raise TemplateError(f"no template {name!r}")
        return self.render(self.defines[name], ctx, ChainMap({"$": ctx}))


_NOTHING = object()
_DECLARED = object()


# ---- the chart, as `helm template` renders it --------------------------------------------------------


class _Files:
    def __init__(self, root: Path):
        self._root = root

    def Get(self, name: str) -> str:  # Helm's name
        return (self._root / name).read_text()


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def chart_values(overrides: dict | None = None) -> dict:
    """values.yaml with `overrides` merged in, as `--set`/`-f` would."""
    return _merge(yaml.safe_load((CHART / "values.yaml").read_text()), overrides or {})


def _render_texts(
    overrides: dict | None, release: str, namespace: str, cluster: Sequence[dict]
) -> dict[str, str]:
    """{template file: rendered text} for templates/*.yaml and NOTES.txt."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = chart_values(overrides)
    jsonschema.validate(values, json.loads((CHART / "values.schema.json").read_text()))
    ctx = {
        "Values": values,
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
        "Files": _Files(CHART),
    }
    templates = CHART / "templates"
    trees = {p.name: parse(p.read_text()) for p in sorted(templates.glob("*.tpl"))}
    trees |= {p.name: parse(p.read_text()) for p in sorted(templates.glob("*.yaml"))}
    trees["NOTES.txt"] = parse((templates / "NOTES.txt").read_text())
    defines = {
        n[1]: n[2] for tree in trees.values() for n in tree if isinstance(n, list) and n[0] == "define"
    }
    r = Renderer(defines, cluster)
    return {
        name: r.render(tree, ctx, ChainMap({"$": ctx}))
        for name, tree in trees.items()
        if name.endswith((".yaml", ".txt"))
    }


def render_chart(
    overrides: dict | None = None,
    release: str = "fleetprof",
    namespace: str = "fleetprof",
    cluster: Sequence[dict] = (),
) -> dict[str, list[dict]]:
    """{template file: [objects]}, like `helm template RELEASE helm/fleetprof -n NAMESPACE --set ...`; with
    `cluster` (the objects already there) like `helm upgrade`, whose `lookup` finds them."""
    texts = _render_texts(overrides, release, namespace, cluster)
    return {
        name: [d for d in yaml.safe_load_all(text) if d]
        for name, text in texts.items()
        if name.endswith(".yaml")
    }


def render_notes(
    overrides: dict | None = None, release: str = "fleetprof", namespace: str = "fleetprof"
) -> str:
    """What `helm install` prints: templates/NOTES.txt rendered."""
    return _render_texts(overrides, release, namespace, ())["NOTES.txt"]


def all_objects(rendered: dict[str, list[dict]]) -> list[dict]:
    """The objects of every template file of a `render_chart` result."""
    return [o for objs in rendered.values() for o in objs]
