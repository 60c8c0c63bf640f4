// Statistics and the full invariant check used by the property tests.
#include <algorithm>
#include <string>

#include "pagedinfer/block_manager.h"

namespace pagedinfer {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw InvariantError(what);
}

std::string block_name(int32_t block) { return "block " + std::to_string(block); }

}  // namespace

BlockManagerStats BlockManager::stats() const {
  BlockManagerStats s;
  s.total_blocks = pool_.num_blocks();
  s.free_blocks = pool_.num_free();
  s.cached_blocks = pool_.num_evictable();
  s.used_blocks = s.total_blocks - s.free_blocks - s.cached_blocks;
  // A block shared by several sequences stores as many tokens as its fullest user.
  std::vector<int32_t> fill(pool_.num_blocks(), 0);
  for (const auto& [seq_id, seq] : seqs_) {
    int64_t len = static_cast<int64_t>(seq.tokens.size());
    for (size_t i = 0; i < seq.blocks.size(); ++i) {
      int64_t in_block =
          std::min<int64_t>(block_size_, len - static_cast<int64_t>(i) * block_size_);
      fill[seq.blocks[i]] = std::max(fill[seq.blocks[i]], static_cast<int32_t>(in_block));
    }
  }
  for (int32_t n : fill) s.stored_tokens += n;
  s.prefix_cache_hits = prefix_cache_hits_;
  s.prefix_cache_queries = prefix_cache_queries_;
  s.cow_copies = cow_copies_;
  s.evictions = evictions_;
  s.num_sequences = static_cast<int64_t>(seqs_.size());
  return s;
}

void BlockManager::check_invariants() const {
  check_blocks();
  check_sequences();
}

// Every block is exactly one of free / in use / evictable, and the hash index is consistent.
void BlockManager::check_blocks() const {
  int32_t n = pool_.num_blocks();
  std::vector<int32_t> state(n, 0);  // 1 free, 2 evictable, 3 in use
  for (int32_t block : pool_.free_list()) {
    require(block >= 0 && block < n && state[block] == 0, "free list holds a bad or repeated id");
    require(pool_.refcount(block) == 0 && !cache_.is_registered(block),
            block_name(block) + " on the free list is referenced or cached");
    state[block] = 1;
  }
  std::vector<int32_t> lru = pool_.lru_order();
  require(static_cast<int32_t>(lru.size()) == pool_.num_evictable(), "LRU list length mismatch");
  for (int32_t block : lru) {
    require(state[block] == 0 && pool_.is_evictable(block), block_name(block) + " LRU twice");
    require(pool_.refcount(block) == 0 && cache_.is_registered(block),
            block_name(block) + " on the LRU list is referenced or not cached");
    state[block] = 2;
  }
  int32_t registered = 0;
  for (int32_t block = 0; block < n; ++block) {
    if (state[block] == 0) {
      require(pool_.refcount(block) > 0, block_name(block) + " is in no state (leaked)");
    }
    if (!cache_.is_registered(block)) continue;
    ++registered;
    require(cache_.find(cache_.hash(block)) == block, block_name(block) + " not indexed");
    if (!cache_.has_valid_parent(block)) continue;
    int32_t parent = cache_.parent(block);
    uint64_t parent_hash = parent >= 0 ? cache_.hash(parent) : kRootHash;
    require(chain_hash(parent_hash, block_tokens(block), block_size_) == cache_.hash(block),
            block_name(block) + " content differs from its hash");
  }
  require(registered == cache_.size(), "hash index size mismatch");
}

// Refcounts equal page-table references; every sequence's tokens are what its blocks hold.
void BlockManager::check_sequences() const {
  std::vector<int32_t> refs(pool_.num_blocks(), 0);
  for (const auto& [seq_id, seq] : seqs_) {
    std::string name = "sequence " + std::to_string(seq_id);
    int64_t len = static_cast<int64_t>(seq.tokens.size());
    require(static_cast<int64_t>(seq.blocks.size()) == blocks_for(len), name + " block count");
    require(seq.num_hashed_blocks >= 0 && seq.num_hashed_blocks <= block_of(len),
            name + " num_hashed_blocks out of range");
    for (size_t i = 0; i < seq.blocks.size(); ++i) {
      int32_t block = seq.blocks[i];
      require(block >= 0 && block < pool_.num_blocks(), name + " holds a bad block id");
      ++refs[block];
      if (static_cast<int32_t>(i) < seq.num_hashed_blocks && enable_prefix_caching_) {
        require(cache_.is_registered(block), name + " hashed block not cached");
      }
    }
    for (int64_t pos = 0; pos < len; ++pos) {
      int32_t block = seq.blocks[block_of(pos)];
      require(block_tokens_[static_cast<size_t>(block) * block_size_ + offset_in_block(pos)] ==
                  seq.tokens[pos],
              name + " token " + std::to_string(pos) + " differs from its block's content");
    }
  }
  for (int32_t block = 0; block < pool_.num_blocks(); ++block) {
    require(refs[block] == pool_.refcount(block),
            block_name(block) + " refcount " + std::to_string(pool_.refcount(block)) +
                " != " + std::to_string(refs[block]) + " page-table references");
  }
}

}  // namespace pagedinfer
