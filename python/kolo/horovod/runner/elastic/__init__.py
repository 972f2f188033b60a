"""horovodrun's elastic mode, on kolo's elastic driver (in place)."""
