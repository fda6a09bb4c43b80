"""Walking a radix tree a node at a time while it keeps changing (WatchEvents snapshots).

A snapshot stream must not copy the tree up front (40 unread snapshot streams once held 40
copies of it): it walks the live tree, one node per step, and the tree may change between two
steps (the stream waits for its reader in between). The walk is *fuzzy*: started just after
event S, it yields every page that was cached at S and is still cached when the walk gets
there, and perhaps pages cached after S. Applying the events after S to what it yielded gives
the tree as it is, provided applying is idempotent per page (a BlockStored of known pages, a
BlockRemoved of unknown ones change nothing), as a page-keyed mirror is (examples/kv_mirror.py):

- a page that no event after S touched is cached now iff it was at S, and the walk reaches it
  (below);
- a page that some event after S touched ends as that page's last event says, whatever the walk
  yielded before.

Reaching every untouched page: a node's children are listed when the node is visited (a tuple of
references, the walk's only memory: one pointer per listed sibling not visited yet); an insert
adds nodes whose pages have events; an eviction removes pages with an event. A split (which has
no event) puts a new head node, holding pages cached at S, between a listed child and its parent:
so before a listed child the walk yields the heads now above it that are still in the tree, even
when the child itself has gone (an eviction of part of a leaf splits it first). A node's event is
built in the step that visits it, from the node as it is then.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from cache_service.events import BlockStored, stored_from_node
from cache_service.radix_tree import RadixTree, TreeNode


def walk_live(tree: RadixTree, namespaces: Iterable[str], tier: int = 0) -> Iterator[BlockStored]:
    """BlockStored events of the tree's nodes in `namespaces` (in that order), parents before
    children; the tree may change between two steps (see the module docstring). `tier`: the tier
    whose tree it is (a lower tier's events carry its slot ids as block ids)."""
    page_size = tree.page_size
    for namespace in namespaces:
        root = tree.root(namespace)
        if root is None:
            continue
        stack: list[tuple[TreeNode, Iterator[TreeNode]]] = [(root, iter(tuple(root.children.values())))]
        while stack:
            parent, listed = stack[-1]
            child = next(listed, None)
            if child is None:
                stack.pop()
                continue
            heads = []  # split off above `child` since it was listed
            node = child.parent
            while node is not None and node is not parent and node.parent is not None:
                if node.in_tree:
                    heads.append(node)
                node = node.parent
            found = [stored_from_node(head, page_size, tier) for head in reversed(heads)]
            if child.in_tree:
                found.append(stored_from_node(child, page_size, tier))
                if child.children:
                    stack.append((child, iter(tuple(child.children.values()))))
            yield from found
