"""Does a chat template insert message contents verbatim? A conservative proof on its syntax tree.

When it does, and the rest of the render depends only on the conversation's roles, a
conversation's text is its role-shape's skeleton (``chat_render._Skeleton``) with the contents
put in place, and jinja need not run per sample. The proof walks the template's jinja AST:

- lists of messages are ``messages``, its slices, and names bound to those by ``set``; a
  message is a list indexed by anything (itself checked), the target of a ``for`` over a list,
  or a name ``set`` to a message;
- a message may only be read as ``m['role']`` / ``m.role`` (the skeleton's key) or as
  ``m['content']`` / ``m.content`` where that value is output as is: directly in ``{{ }}``, or
  joined there with ``~`` or with ``+`` between plain strings (``+`` with a Markup value would
  escape it); argument-free type tests that are constant on string contents (``is string``,
  ``is defined``, ...) and ``list | length`` are allowed too;
- any other use fails the proof: a filter, test, condition or index on a content, ``tojson``, a
  message passed to a macro or a namespace, ``loop.previtem``, other message keys, blocks and
  ``self``, rebinding ``loop``, ``{% autoescape %}``, includes and imports, and calls whose
  output varies between renders (``strftime_now``, ``lipsum``: a skeleton would freeze it).

A template the proof rejects is not wrong: the caller renders it per sample and compares.
jinja2 has no dataflow analysis of its own, hence this walk.
"""

from __future__ import annotations

from jinja2 import Environment, nodes

# Argument-free tests whose result is the same for every string content (contents are checked
# to be str before rendering).
_CONSTANT_TESTS = frozenset({"string", "defined", "undefined", "none", "mapping", "sequence",
                             "iterable"})
# Bodies whose output is captured (and may be transformed) instead of written out.
_CAPTURING = (nodes.AssignBlock, nodes.FilterBlock, nodes.Macro, nodes.CallBlock)
# Code out of the proof's sight (other templates, blocks re-rendered through ``self``) or
# changing how values are written (``{% autoescape %}``).
_OPAQUE = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends, nodes.Block,
           nodes.ScopedEvalContextModifier, nodes.EvalContextModifier)
# Names the proof gives a meaning (the loop object, blocks) or refuses (calls whose output
# changes between renders: a skeleton would freeze it).
_SPECIAL_NAMES = frozenset({"loop", "self", "super"})
_VARYING_CALLS = frozenset({"strftime_now", "lipsum"})
LIST, MESSAGE = "list", "message"


class _Unproven(Exception):
    """A use of messages the proof does not allow."""


def contents_inserted_verbatim(environment: Environment, source: str) -> bool:
    """True when ``source`` provably uses each message's content only by outputting it as is
    (in an ``environment`` that writes values out unchanged: no autoescape, no finalize)."""
    if environment.autoescape is not False or environment.finalize is not None:
        return False
    try:
        tree = environment.parse(source)
    except Exception:   # a syntax the environment cannot parse: no proof
        return False
    try:
        return _Proof(tree).safe(tree, outputting=False)
    except _Unproven:
        return False


def _target_name(target) -> str | None:
    """The name a ``for``/``set`` target binds (None: a tuple or ``ns.attr`` target, which the
    proof does not follow)."""
    return target.name if isinstance(target, nodes.Name) else None


def _no_arguments(node) -> bool:
    return not (node.args or node.kwargs or node.dyn_args or node.dyn_kwargs)


class _Proof:
    """One template's names bound to lists and messages, and the walk over its tree."""

    def __init__(self, tree: nodes.Template) -> None:
        self.kinds: dict[str, str] = {"messages": LIST}
        self.stored = {name.name for name in tree.find_all(nodes.Name)
                       if name.ctx in ("store", "param")}
        if self.stored & _SPECIAL_NAMES:    # e.g. {% set loop = messages %}: loop.count(...)
            raise _Unproven
        while True:     # names bound to lists/messages, through other names, to a fixpoint
            before = dict(self.kinds)
            for node in tree.find_all((nodes.For, nodes.Assign)):
                kind = self.kind(node.iter if isinstance(node, nodes.For) else node.node,
                                 checked=False)
                if kind is None:
                    continue
                if isinstance(node, nodes.For):
                    if kind != LIST:
                        raise _Unproven                 # a loop over a message's keys
                    kind = MESSAGE
                name = _target_name(node.target)
                if name is None or self.kinds.get(name, kind) != kind:
                    raise _Unproven
                self.kinds[name] = kind
            if self.kinds == before:
                break

    def kind(self, node, checked: bool = True) -> str | None:
        """LIST or MESSAGE for an expression holding messages, None for anything else; an
        index on a message, or (when ``checked``) an unsafe index, raises _Unproven."""
        if isinstance(node, nodes.Name):
            return self.kinds.get(node.name)
        if isinstance(node, nodes.Getitem):
            if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
                return None                                   # a key: see key()
            inner = self.kind(node.node, checked)
            if inner is None:
                return None
            if inner != LIST or (checked and not self.safe(node.arg, outputting=False)):
                raise _Unproven
            return LIST if isinstance(node.arg, nodes.Slice) else MESSAGE
        return None

    def key(self, node) -> str | None:
        """The key of ``m['key']`` / ``m.key`` on a message ``m``, else None."""
        if isinstance(node, nodes.Getattr) and self.kind(node.node) == MESSAGE:
            return node.attr
        if (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
                and isinstance(node.arg.value, str) and self.kind(node.node) == MESSAGE):
            return node.arg.value
        return None

    def plain(self, node) -> bool:
        """Statically a plain str, never Markup (which escapes what ``+`` joins to it)."""
        if isinstance(node, nodes.Const | nodes.TemplateData):
            return isinstance(node.value, str)
        if isinstance(node, nodes.Concat) or self.key(node) in ("role", "content"):
            return True
        if isinstance(node, nodes.Name):    # a render argument (bos_token, ...), never set
            return node.name not in self.stored and node.name not in self.kinds
        if isinstance(node, nodes.Add):
            return self.plain(node.left) and self.plain(node.right)
        if isinstance(node, nodes.CondExpr):
            return self.plain(node.expr1) and (node.expr2 is None or self.plain(node.expr2))
        return False

    def safe(self, node, outputting: bool) -> bool:
        """No use of a message under ``node`` other than the allowed ones (module docstring);
        ``outputting``: ``node``'s value goes to the output as is."""
        key = self.key(node)
        if key is not None:
            return key == "role" or (key == "content" and outputting)
        if isinstance(node, _OPAQUE):
            return False
        if isinstance(node, _CAPTURING):
            return not any(name.name in self.kinds or name.name in _SPECIAL_NAMES
                           for name in node.find_all(nodes.Name))
        if isinstance(node, nodes.Test) and node.name in _CONSTANT_TESTS and _no_arguments(node):
            if self.key(node.node) == "content" or self.kind(node.node) is not None:
                return True
        if (isinstance(node, nodes.Filter) and node.name in ("length", "count")
                and _no_arguments(node) and node.node is not None
                and self.kind(node.node) == LIST):
            return True
        if isinstance(node, nodes.For) and self.kind(node.iter) is not None:
            children = [*node.body, *node.else_] + ([node.test] if node.test else [])
            return not node.recursive and all(self.safe(child, False) for child in children)
        if isinstance(node, nodes.Assign) and self.kind(node.node) is not None:
            return True                 # target checked when the names were collected
        if (isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name)
                and node.node.name == "loop"):
            return node.attr not in ("previtem", "nextitem")
        if isinstance(node, nodes.Name):
            return not (node.name in self.kinds or node.name in _SPECIAL_NAMES
                        or node.name in _VARYING_CALLS)
        if self.kind(node) is not None:
            return False                # a list or message used as a whole
        if isinstance(node, nodes.Output):
            return all(self.safe(child, True) for child in node.nodes)
        if isinstance(node, nodes.CondExpr):
            return (self.safe(node.test, False) and self.safe(node.expr1, outputting)
                    and (node.expr2 is None or self.safe(node.expr2, outputting)))
        passes = outputting and (isinstance(node, nodes.Concat) or (
            isinstance(node, nodes.Add) and self.plain(node.left) and self.plain(node.right)))
        return all(self.safe(child, passes) for child in node.iter_child_nodes())
