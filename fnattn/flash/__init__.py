"""Flash attention: blockwise online softmax with O(T) memory, three lowerings."""
