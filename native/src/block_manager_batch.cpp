// Per-step batch operations: mark_computed (prefix-cache registration), the placeholder fix-ups
// (set_last_tokens, set_tokens) and build_batch.
#include <algorithm>
#include <climits>
#include <string>

#include "pagedinfer/block_manager.h"

namespace pagedinfer {

BatchArrays::BatchArrays(int64_t batch_, int64_t max_blocks_, int64_t num_new_tokens)
    : batch(batch_),
      max_blocks(max_blocks_),
      block_tables(batch_ * max_blocks_),
      slot_mapping(num_new_tokens),
      positions(num_new_tokens),
      context_lens(batch_),
      query_start_loc(batch_ + 1) {}

void BlockManager::mark_computed(const int64_t* seq_ids, const int32_t* num_computed,
                                 int64_t batch) {
  std::vector<Sequence*> seqs;
  seqs.reserve(batch);
  for (int64_t i = 0; i < batch; ++i) {
    Sequence& seq = get(seq_ids[i]);
    if (num_computed[i] < 0 || num_computed[i] > static_cast<int64_t>(seq.tokens.size())) {
      throw std::invalid_argument("num_computed_tokens " + std::to_string(num_computed[i]) +
                                  " out of range for sequence " + std::to_string(seq_ids[i]) +
                                  " of " + std::to_string(seq.tokens.size()) + " tokens");
    }
    seqs.push_back(&seq);
  }
  if (!enable_prefix_caching_) return;
  for (int64_t i = 0; i < batch; ++i) cache_full_blocks(seqs[i], num_computed[i]);
}

// Offers the sequence's full computed blocks to the prefix cache, in order. A block whose content
// is already cached in another block is replaced by that block (the duplicate is released), so
// identical prefixes converge on one chain. Never allocates, never throws.
void BlockManager::cache_full_blocks(Sequence* seq, int64_t num_computed) {
  int64_t num_full = block_of(num_computed);
  for (int64_t i = seq->num_hashed_blocks; i < num_full; ++i) {
    int32_t block = seq->blocks[i];
    int32_t parent = i > 0 ? seq->blocks[i - 1] : -1;
    if (!cache_.is_registered(block)) {
      const int32_t* tokens = seq->tokens.data() + i * block_size_;
      uint64_t h = chain_hash(parent >= 0 ? cache_.hash(parent) : kRootHash, tokens, block_size_);
      int32_t cached = cache_.find(h);
      if (cached < 0) {
        cache_.insert(block, h, parent);
      } else if (cache_.is_child_of(cached, parent) && same_tokens(cached, tokens)) {
        pool_.incref(cached);
        seq->blocks[i] = cached;
        release_block(block);
      } else if (!cache_.has_valid_parent(cached) && pool_.refcount(cached) == 0) {
        // An unreachable leftover (its parent was modified or evicted): replace it.
        cache_.erase(cached);
        pool_.evictable_to_free(cached);
        cache_.insert(block, h, parent);
      } else {
        return;  // a genuine 64-bit hash collision: stop caching this sequence here
      }
    }
    seq->num_hashed_blocks = static_cast<int32_t>(i + 1);
  }
}

void BlockManager::set_last_tokens(const int64_t* seq_ids, const int32_t* tokens, int64_t batch) {
  std::vector<Sequence*> seqs = distinct_sequences(seq_ids, batch);
  for (int64_t i = 0; i < batch; ++i) {
    const Sequence& seq = *seqs[i];
    int64_t last = static_cast<int64_t>(seq.tokens.size()) - 1;
    std::string name = "sequence " + std::to_string(seq_ids[i]);
    if (last < 0) throw std::invalid_argument(name + " has no token to replace");
    if (block_of(last) < seq.num_hashed_blocks) {
      throw std::invalid_argument(name + ": its last token's block is already prefix-cached");
    }
    if (pool_.refcount(seq.blocks[block_of(last)]) != 1) {
      throw std::invalid_argument(name + ": its last token's block is shared");
    }
  }
  for (int64_t i = 0; i < batch; ++i) {
    Sequence* seq = seqs[i];
    int64_t last = static_cast<int64_t>(seq->tokens.size()) - 1;
    seq->tokens[last] = tokens[i];
    int32_t block = seq->blocks[block_of(last)];
    if (cache_.is_registered(block)) cache_.erase(block);  // a truncated block, content changes
    block_tokens_[static_cast<size_t>(block) * block_size_ + offset_in_block(last)] = tokens[i];
  }
}

void BlockManager::set_tokens(int64_t seq_id, int64_t start, const int32_t* tokens,
                              int64_t num_tokens) {
  Sequence& seq = get(seq_id);
  if (num_tokens == 0) return;
  int64_t length = static_cast<int64_t>(seq.tokens.size());
  std::string name = "sequence " + std::to_string(seq_id);
  if (start < 0 || num_tokens < 0 || start > length - num_tokens) {
    throw std::invalid_argument(name + ": " + std::to_string(num_tokens) +
                                " tokens from position " + std::to_string(start) +
                                " do not fit in its " + std::to_string(length) + " tokens");
  }
  int64_t first = block_of(start);
  int64_t last = block_of(start + num_tokens - 1);
  // Hashed blocks are leading, so checking the first touched one covers them all.
  if (first < seq.num_hashed_blocks) {
    throw std::invalid_argument(name + ": position " + std::to_string(start) +
                                " is in a block that is already prefix-cached");
  }
  for (int64_t i = first; i <= last; ++i) {
    if (pool_.refcount(seq.blocks[i]) != 1) {
      throw std::invalid_argument(name + ": its block " + std::to_string(i) + " is shared");
    }
  }
  for (int64_t i = first; i <= last; ++i) {
    // Registered past num_hashed_blocks only after a truncate; its content changes now.
    if (cache_.is_registered(seq.blocks[i])) cache_.erase(seq.blocks[i]);
  }
  std::copy(tokens, tokens + num_tokens, seq.tokens.begin() + start);
  for (int64_t pos = start; pos < start + num_tokens; ++pos) {
    int32_t block = seq.blocks[block_of(pos)];
    block_tokens_[static_cast<size_t>(block) * block_size_ + offset_in_block(pos)] =
        tokens[pos - start];
  }
}

BatchArrays BlockManager::build_batch(const int64_t* seq_ids, const int32_t* num_computed,
                                      const int32_t* num_new, int64_t batch,
                                      int64_t max_blocks) const {
  std::vector<const Sequence*> seqs;
  seqs.reserve(batch);
  int64_t num_new_tokens = 0;
  int64_t width = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const Sequence& seq = sequence(seq_ids[i]);
    int64_t context = static_cast<int64_t>(num_computed[i]) + num_new[i];
    if (num_computed[i] < 0 || num_new[i] < 0 ||
        context > static_cast<int64_t>(seq.tokens.size())) {
      throw std::invalid_argument("sequence " + std::to_string(seq_ids[i]) + ": computed " +
                                  std::to_string(num_computed[i]) + " + new " +
                                  std::to_string(num_new[i]) + " tokens is out of range for its " +
                                  std::to_string(seq.tokens.size()) + " tokens");
    }
    num_new_tokens += num_new[i];
    width = std::max(width, blocks_for(context));
    seqs.push_back(&seq);
  }
  if (num_new_tokens > INT32_MAX) throw std::invalid_argument("too many new tokens for int32");
  if (max_blocks >= 0 && max_blocks < width) {
    throw std::invalid_argument("max_blocks " + std::to_string(max_blocks) + " < " +
                                std::to_string(width) + " blocks needed by the batch");
  }
  BatchArrays out(batch, max_blocks >= 0 ? max_blocks : width, num_new_tokens);
  int32_t cursor = 0;
  out.query_start_loc.data[0] = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const std::vector<int32_t>& blocks = seqs[i]->blocks;
    int32_t begin = num_computed[i];
    int32_t end = begin + num_new[i];
    int64_t used = blocks_for(end);
    int32_t* row = out.block_tables.data.get() + i * out.max_blocks;
    std::copy(blocks.begin(), blocks.begin() + used, row);
    std::fill(row + used, row + out.max_blocks, 0);
    // One block at a time: slots inside a block are consecutive (vectorisable inner loop).
    for (int32_t pos = begin; pos < end;) {
      int32_t offset = offset_in_block(pos);
      int32_t run = std::min(block_size_ - offset, end - pos);
      int32_t first_slot = blocks[block_of(pos)] * block_size_ + offset;
      int32_t* slots = out.slot_mapping.data.get() + cursor;
      int32_t* positions = out.positions.data.get() + cursor;
      for (int32_t k = 0; k < run; ++k) {
        slots[k] = first_slot + k;
        positions[k] = pos + k;
      }
      pos += run;
      cursor += run;
    }
    out.context_lens.data[i] = end;
    out.query_start_loc.data[i + 1] = cursor;
  }
  return out;
}

}  // namespace pagedinfer
