"""Python-aware stacks: detect CPython processes, hand their layout to BPF, name their frames."""
