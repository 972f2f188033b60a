"""What the Keras support needs of a variable or an optimizer, for Keras 3
(`keras`, on any backend) and Keras 2 (`tf_keras`, TensorFlow's `tf.keras`
under TF_USE_LEGACY_KERAS=1) alike."""

import keras
import numpy as np


def is_keras2(obj):
    """Whether `obj` (an optimizer, a model) is tf-keras's (Keras 2)."""
    return any(c.__module__.startswith("tf_keras.") for c in type(obj).__mro__)


def value_of(variable):
    """A variable's value as a numpy array."""
    if isinstance(variable, keras.Variable):
        return np.asarray(keras.ops.convert_to_numpy(variable.value))
    return np.asarray(variable.numpy())


def optimizer_variables(optimizer):
    """An optimizer's variables: none for a Keras 3 optimizer not built yet
    (Keras builds it on the first update)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return list(optimizer.variables) if optimizer.built else []
    # tf-keras: a property (new optimizers) or a method (legacy ones)
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def model_variables(model, optimizer=None, skip=()):
    """The model's variables and its optimizer's, less those in `skip`."""
    skipped = {id(v) for v in skip or ()}
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    found = list(model.variables) + optimizer_variables(optimizer)
    return [v for v in found if id(v) not in skipped]


def learning_rate(optimizer):
    rate = optimizer.learning_rate
    if hasattr(rate, "assign"):
        return float(value_of(rate))
    if isinstance(optimizer, keras.optimizers.Optimizer):
        # a backend's tensor (on a GPU, say)
        return float(keras.ops.convert_to_numpy(rate))
    return float(np.asarray(rate))


def classes_for(keras_module, mixins, module):
    """Each mixin made into a class of `keras_module`'s callbacks (the
    mixin's `_BASE` names which, `Callback` by default; a mixin deriving
    from another gets the other's made class), named for `module`, where
    the caller puts them, so that pickle finds them by name. Made once per
    Keras and mixins: the module that asks first names them."""
    key = (keras_module.callbacks.Callback, mixins)
    if key in _MADE:
        return _MADE[key]
    made = {}
    for mixin in mixins:
        parent = next((made[b.__name__] for b in mixin.__bases__ if b.__name__ in made), None)
        base = parent or getattr(keras_module.callbacks, getattr(mixin, "_BASE", "Callback"))
        made[mixin.__name__] = type(mixin.__name__, (mixin, base), {"__module__": module, "__doc__": mixin.__doc__})
    _MADE[key] = made
    return made


_MADE = {}


def momentum_variable(optimizer):
    """The optimizer's momentum where a variable holds it (else None: a
    plain number cannot be corrected mid-step)."""
    momentum = getattr(optimizer, "momentum", None)
    return momentum if hasattr(momentum, "assign") else None
