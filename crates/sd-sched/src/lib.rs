//! Graph-cut segment planning and the executor that stages, evicts and prefetches weights.
