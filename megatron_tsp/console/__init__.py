"""What every command-line entry point shares (the ``megatron-tsp`` tools, the CPU runner, the
package's import in a spawned rank): one-line argument errors (``args``) and library warnings
folded into one line (``quiet``). Standard library only, so any layer may use it."""
