"""Flash attention: blockwise online softmax, O(T) memory (lowerings: :mod:`fnattn.flash.api`)."""
