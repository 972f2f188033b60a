"""The texts of horovodrun's elastic errors, as scripts and tests match them."""

RESET_LIMIT_EXCEEDED_MESSAGE = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"
