"""Does a chat template insert message contents verbatim? A conservative proof on its syntax tree.

When it does, and the rest of the render depends only on the conversation's roles, a
conversation's text is its role-shape's skeleton (``chat_tokens._Skeleton``) with the contents
put in place, and jinja need not run per sample. The proof walks the template's jinja AST:

- names that hold messages are ``messages``, the targets of ``for`` loops over them and of
  ``set`` from them, and indexes/slices of those;
- a message may only be read as ``m['role']`` / ``m.role`` (the skeleton's key) or as
  ``m['content']`` / ``m.content`` where that value is output as is: directly in ``{{ }}`` or
  joined there with ``+`` / ``~``; type tests that are constant on string contents
  (``is string``, ``is defined``, ...) are allowed too;
- ``messages | length`` is allowed (it is part of the shape);
- any other use (a filter or test on the content, a condition on it, ``tojson``, passing a
  message to a macro or a namespace, ``loop.previtem``, other message keys) fails the proof.

A template the proof rejects is not wrong: the caller renders it per sample and compares.
jinja2 has no dataflow analysis of its own, hence this walk.
"""

from __future__ import annotations

from jinja2 import Environment, nodes

# Tests whose result is the same for every string content (contents are checked to be str).
_CONSTANT_TESTS = frozenset({"string", "defined", "undefined", "none", "mapping", "sequence",
                             "iterable"})


def contents_inserted_verbatim(environment: Environment, source: str) -> bool:
    """True when ``source`` provably uses each message's content only by outputting it as is
    (in an ``environment`` that writes values out unchanged: no autoescape, no finalize)."""
    if environment.autoescape is not False or environment.finalize is not None:
        return False
    try:
        tree = environment.parse(source)
    except Exception:   # a syntax the environment cannot parse: no proof
        return False
    holders = {"messages"}
    while True:     # names bound (directly or through other names) to messages, to a fixpoint
        bound = {name for node in tree.find_all((nodes.For, nodes.Assign))
                 if _is_holder(node.iter if isinstance(node, nodes.For) else node.node, holders)
                 for name in _target_names(node.target)}
        if bound <= holders:
            break
        holders |= bound
    return _safe(tree, holders, outputting=False)


def _target_names(target) -> set[str]:
    if isinstance(target, nodes.Name):
        return {target.name}
    if isinstance(target, nodes.Tuple):
        return {name for item in target.items for name in _target_names(item)}
    return set()    # ns.attr: a holder assigned there fails the proof in _safe


def _is_holder(node, holders: set[str]) -> bool:
    """Is ``node`` a message or a list of messages: a name of ``holders``, indexed or sliced
    by anything but a constant string (that reads a key)?"""
    if isinstance(node, nodes.Name):
        return node.name in holders
    if isinstance(node, nodes.Getitem):
        reads_key = isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str)
        return not reads_key and _is_holder(node.node, holders)
    return False


def _message_key(node, holders: set[str]) -> str | None:
    """The key of ``m['key']`` / ``m.key`` on a message holder ``m``, else None."""
    if isinstance(node, nodes.Getattr) and _is_holder(node.node, holders):
        return node.attr
    if (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
            and isinstance(node.arg.value, str) and _is_holder(node.node, holders)):
        return node.arg.value
    return None


# Bodies whose output is captured (and may be transformed) instead of written out.
_CAPTURING = (nodes.AssignBlock, nodes.FilterBlock, nodes.Macro, nodes.CallBlock)
# Other templates' code is out of the proof's sight.
_FOREIGN = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)


def _safe(node, holders: set[str], outputting: bool) -> bool:
    """No use of a message under ``node`` other than the allowed ones (module docstring);
    ``outputting``: ``node``'s value goes to the output as is."""
    key = _message_key(node, holders)
    if key is not None:
        return key == "role" or (key == "content" and outputting)
    if isinstance(node, _FOREIGN):
        return False
    if isinstance(node, _CAPTURING):
        return not any(name.name in holders or name.name == "loop"
                       for name in node.find_all(nodes.Name))
    if isinstance(node, nodes.Test) and node.name in _CONSTANT_TESTS and not node.args:
        if _message_key(node.node, holders) == "content" or _is_holder(node.node, holders):
            return True
    if (isinstance(node, nodes.Filter) and node.name in ("length", "count") and not node.args
            and node.node is not None and _is_holder(node.node, holders)):
        return True
    if isinstance(node, nodes.For) and _is_holder(node.iter, holders):
        children = [*node.body, *node.else_] + ([node.test] if node.test else [])
        return not node.recursive and all(_safe(child, holders, False) for child in children)
    if isinstance(node, nodes.Assign) and _is_holder(node.node, holders):
        return isinstance(node.target, nodes.Name)
    if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) \
            and node.node.name == "loop":
        return node.attr not in ("previtem", "nextitem")
    if isinstance(node, nodes.Name):
        return node.name not in holders and node.name != "loop"
    if _is_holder(node, holders):
        return False
    if isinstance(node, nodes.Output):
        return all(_safe(child, holders, True) for child in node.nodes)
    if isinstance(node, nodes.CondExpr):
        return (_safe(node.test, holders, False) and _safe(node.expr1, holders, outputting)
                and (node.expr2 is None or _safe(node.expr2, holders, outputting)))
    passes = outputting and isinstance(node, nodes.Add | nodes.Concat)
    return all(_safe(child, holders, passes) for child in node.iter_child_nodes())
