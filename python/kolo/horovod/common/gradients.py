"""What every framework's gradient reduction shares: the worker-local
variables, whose gradients are not reduced (upstream's
`register_local_var`), and the split around them."""


class LocalVariables:
    """Variables registered as worker-local, by identity (Keras 3's
    variables are neither hashable nor `ref()`-able); an object no
    framework tracks."""

    def __init__(self):
        self._held = {}

    def add(self, v):
        self._held[id(v)] = v

    def __contains__(self, v):
        return id(v) in self._held

    def __len__(self):
        return len(self._held)


def reduce_with_locals(grads, sources, local_variables, reduce):
    """`reduce(grads, sources)` over the gradients of global sources; the
    local ones kept as they are."""
    grads = list(grads)
    shared = [i for i, s in enumerate(sources) if s not in local_variables]
    reduced = reduce([grads[i] for i in shared], [sources[i] for i in shared])
    for i, r in zip(shared, reduced):
        grads[i] = r
    return grads


def scale_locals(grads, sources, local_variables, divide):
    """The local gradients passed through `divide` (by the set's size, as
    upstream's scale_local_gradients), the others as they are."""
    if not len(local_variables):
        return list(grads)
    return [divide(g) if g is not None and s in local_variables else g for g, s in zip(grads, sources)]
