"""User-stack unwinding from an ELF file's call-frame information: CFI parser and the compact BPF table."""
