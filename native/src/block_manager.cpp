#include "pagedinfer/block_manager.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

namespace pagedinfer {
namespace {

std::string seq_name(int64_t seq_id) { return "sequence " + std::to_string(seq_id); }

// Makes room for `size` elements with geometric growth (a bare reserve(size) would reallocate on
// every append and make appends quadratic).
void reserve_amortized(std::vector<int32_t>* v, int64_t size) {
  if (static_cast<size_t>(size) > v->capacity()) {
    v->reserve(std::max(static_cast<size_t>(size), 2 * v->capacity()));
  }
}

// Validates the constructor arguments before any member allocates memory.
int32_t checked_num_blocks(int32_t num_blocks, int32_t block_size) {
  if (num_blocks <= 0) throw std::invalid_argument("num_blocks must be positive");
  if (block_size <= 0) throw std::invalid_argument("block_size must be positive");
  if (static_cast<int64_t>(num_blocks) * block_size > INT32_MAX) {
    throw std::invalid_argument("num_blocks * block_size must fit in int32 (slot ids)");
  }
  return num_blocks;
}

int32_t log2_if_power_of_two(int32_t n) {
  if (n <= 0 || (n & (n - 1)) != 0) return -1;
  int32_t shift = 0;
  while ((1 << shift) < n) ++shift;
  return shift;
}

}  // namespace

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching)
    : block_size_(block_size),
      shift_(log2_if_power_of_two(block_size)),
      enable_prefix_caching_(enable_prefix_caching),
      pool_(checked_num_blocks(num_blocks, block_size)),
      cache_(num_blocks),
      block_tokens_(static_cast<size_t>(num_blocks) * block_size, 0) {}

const Sequence& BlockManager::sequence(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) throw UnknownSequenceError("unknown " + seq_name(seq_id));
  return it->second;
}

Sequence& BlockManager::get(int64_t seq_id) {
  return const_cast<Sequence&>(static_cast<const BlockManager*>(this)->sequence(seq_id));
}

void BlockManager::require_blocks(int64_t needed, const char* what) const {
  if (needed > pool_.num_available()) {
    throw OutOfBlocksError(std::string(what) + " needs " + std::to_string(needed) +
                           " blocks but only " + std::to_string(pool_.num_available()) +
                           " are free or evictable");
  }
}

int32_t BlockManager::allocate_block() {
  if (pool_.num_free() > 0) return pool_.pop_free();
  int32_t block = pool_.pop_lru();
  cache_.erase(block);
  ++evictions_;
  return block;
}

void BlockManager::release_block(int32_t block) {
  if (pool_.decref(block) > 0) return;
  if (cache_.is_registered(block)) {
    pool_.push_lru(block);
  } else {
    pool_.push_free(block);
  }
}

bool BlockManager::same_tokens(int32_t block, const int32_t* tokens) const {
  const int32_t* stored = block_tokens_.data() + static_cast<size_t>(block) * block_size_;
  return std::memcmp(stored, tokens, sizeof(int32_t) * block_size_) == 0;
}

void BlockManager::match_prefix(const int32_t* tokens, int64_t num_tokens,
                                std::vector<int32_t>* out) const {
  if (!enable_prefix_caching_) return;
  int32_t parent = -1;
  uint64_t parent_hash = kRootHash;
  for (int64_t i = 0; i + block_size_ <= num_tokens; i += block_size_) {
    uint64_t h = chain_hash(parent_hash, tokens + i, block_size_);
    int32_t block = cache_.find(h);
    if (block < 0 || !cache_.is_child_of(block, parent) || !same_tokens(block, tokens + i)) break;
    out->push_back(block);
    parent = block;
    parent_hash = h;
  }
}

int64_t BlockManager::add_sequence(int64_t seq_id, const int32_t* tokens, int64_t num_tokens) {
  if (seqs_.count(seq_id)) throw DuplicateSequenceError(seq_name(seq_id) + " already exists");
  if (num_tokens < 0) throw std::invalid_argument("num_tokens must be >= 0");
  Sequence seq;
  match_prefix(tokens, num_tokens, &seq.blocks);
  int64_t num_reused = static_cast<int64_t>(seq.blocks.size());
  int64_t reused_evictable = 0;
  for (int32_t block : seq.blocks) reused_evictable += pool_.refcount(block) == 0;
  require_blocks(blocks_for(num_tokens) - num_reused + reused_evictable, "add_sequence");
  seq.blocks.reserve(blocks_for(num_tokens));
  seq.tokens.assign(tokens, tokens + num_tokens);
  seq.num_hashed_blocks = static_cast<int32_t>(num_reused);
  Sequence& stored = seqs_.emplace(seq_id, std::move(seq)).first->second;
  // Nothing below throws. Reused blocks leave the LRU list before any allocation can evict them.
  for (int32_t block : stored.blocks) pool_.incref(block);
  int64_t start = num_reused * block_size_;
  write_tokens(&stored, start, tokens + start, num_tokens - start);
  if (enable_prefix_caching_) {
    prefix_cache_queries_ += num_tokens;
    prefix_cache_hits_ += num_reused * block_size_;
  }
  return num_reused * block_size_;
}

int64_t BlockManager::append_need(const Sequence& seq, int64_t num_tokens) const {
  int64_t len = static_cast<int64_t>(seq.tokens.size());
  int64_t new_blocks = blocks_for(len + num_tokens) - blocks_for(len);
  bool partial_last = offset_in_block(len) != 0;
  bool cow = num_tokens > 0 && partial_last && pool_.refcount(seq.blocks.back()) > 1;
  return new_blocks + (cow ? 1 : 0);
}

int64_t BlockManager::blocks_needed_to_append(int64_t seq_id, int64_t num_tokens) const {
  if (num_tokens < 0) throw std::invalid_argument("num_tokens must be >= 0");
  return append_need(sequence(seq_id), num_tokens);
}

std::optional<BlockCopy> BlockManager::append_tokens(int64_t seq_id, const int32_t* tokens,
                                                     int64_t num_tokens) {
  Sequence& seq = get(seq_id);
  if (num_tokens < 0) throw std::invalid_argument("num_tokens must be >= 0");
  if (num_tokens == 0) return std::nullopt;
  require_blocks(append_need(seq, num_tokens), "append_tokens");
  reserve_append(&seq, num_tokens);
  return append_unchecked(&seq, tokens, num_tokens);
}

int64_t BlockManager::batch_append_need(const Sequence* const* seqs, const int32_t* num_tokens,
                                        int64_t batch) const {
  // New blocks per sequence, plus copies of shared partly filled last blocks: of k writers into
  // a block with refcount r, the first min(k, r - 1) copy; the last may write in place once
  // every other holder has moved away.
  int64_t needed = 0;
  std::unordered_map<int32_t, int32_t> writers;  // shared last block -> appending holders
  for (int64_t i = 0; i < batch; ++i) {
    if (num_tokens[i] < 0) throw std::invalid_argument("num_tokens must be >= 0");
    int64_t len = static_cast<int64_t>(seqs[i]->tokens.size());
    needed += blocks_for(len + num_tokens[i]) - blocks_for(len);
    if (num_tokens[i] > 0 && offset_in_block(len) != 0 &&
        pool_.refcount(seqs[i]->blocks.back()) > 1) {
      ++writers[seqs[i]->blocks.back()];
    }
  }
  for (const auto& [block, count] : writers) needed += std::min(count, pool_.refcount(block) - 1);
  return needed;
}

int64_t BlockManager::blocks_needed_to_append_batch(const int64_t* seq_ids,
                                                    const int32_t* num_tokens,
                                                    int64_t batch) const {
  std::vector<const Sequence*> seqs = distinct_sequences(seq_ids, batch);
  return batch_append_need(seqs.data(), num_tokens, batch);
}

std::vector<BlockCopy> BlockManager::append_tokens_batch(const int64_t* seq_ids,
                                                         const int32_t* num_tokens, int64_t batch,
                                                         const int32_t* token_ids,
                                                         int64_t num_token_ids) {
  std::vector<Sequence*> seqs = distinct_sequences(seq_ids, batch);
  int64_t total = 0;
  for (int64_t i = 0; i < batch; ++i) total += num_tokens[i];
  int64_t needed = batch_append_need(seqs.data(), num_tokens, batch);  // (checks the counts)
  if (total != num_token_ids) {
    throw std::invalid_argument("token_ids holds " + std::to_string(num_token_ids) +
                                " tokens but num_tokens sums to " + std::to_string(total));
  }
  require_blocks(needed, "append_tokens_batch");
  std::vector<BlockCopy> copies;
  copies.reserve(batch);  // (at most one a sequence: push_back below never allocates)
  for (int64_t i = 0; i < batch; ++i) reserve_append(seqs[i], num_tokens[i]);
  // Nothing below throws.
  for (int64_t i = 0; i < batch; ++i) {
    if (num_tokens[i] > 0) {
      if (auto copied = append_unchecked(seqs[i], token_ids, num_tokens[i]))
        copies.push_back(*copied);
    }
    token_ids += num_tokens[i];
  }
  return copies;
}

namespace {

// The sequences of a batch by id, in order, stamping each (Seq: Sequence or const Sequence; the
// stamp is mutable bookkeeping); the first repeated or unknown id throws.
template <typename Seq, typename Lookup>
std::vector<Seq*> stamp_distinct(const int64_t* seq_ids, int64_t batch, uint64_t stamp,
                                 Lookup lookup) {
  std::vector<Seq*> seqs;
  seqs.reserve(batch);
  for (int64_t i = 0; i < batch; ++i) {
    Seq& seq = lookup(seq_ids[i]);
    if (seq.batch_stamp == stamp) {
      throw std::invalid_argument("sequence " + std::to_string(seq_ids[i]) +
                                  " appears twice in one batch");
    }
    seq.batch_stamp = stamp;
    seqs.push_back(&seq);
  }
  return seqs;
}

}  // namespace

std::vector<const Sequence*> BlockManager::distinct_sequences(const int64_t* seq_ids,
                                                              int64_t batch) const {
  return stamp_distinct<const Sequence>(
      seq_ids, batch, ++batch_stamp_,
      [this](int64_t id) -> const Sequence& { return sequence(id); });
}

std::vector<Sequence*> BlockManager::distinct_sequences(const int64_t* seq_ids, int64_t batch) {
  return stamp_distinct<Sequence>(seq_ids, batch, ++batch_stamp_,
                                  [this](int64_t id) -> Sequence& { return get(id); });
}

void BlockManager::reserve_append(Sequence* seq, int64_t num_tokens) {
  int64_t len = static_cast<int64_t>(seq->tokens.size());
  reserve_amortized(&seq->tokens, len + num_tokens);
  reserve_amortized(&seq->blocks, blocks_for(len + num_tokens));
}

// Requires the blocks to be available (checked by the caller) and the room reserved.
std::optional<BlockCopy> BlockManager::append_unchecked(Sequence* seq, const int32_t* tokens,
                                                        int64_t num_tokens) noexcept {
  std::optional<BlockCopy> copied;
  int64_t len = static_cast<int64_t>(seq->tokens.size());
  if (offset_in_block(len) != 0) {
    int32_t last = seq->blocks.back();
    if (pool_.refcount(last) > 1) {
      int32_t copy = allocate_block();
      std::memcpy(&block_tokens_[static_cast<size_t>(copy) * block_size_],
                  &block_tokens_[static_cast<size_t>(last) * block_size_],
                  sizeof(int32_t) * block_size_);
      release_block(last);
      seq->blocks.back() = copy;
      copied = BlockCopy{last, copy};
      ++cow_copies_;
    } else if (cache_.is_registered(last)) {
      cache_.erase(last);  // its content is about to change: never serve it again
    }
  }
  write_tokens(seq, len, tokens, num_tokens);
  seq->tokens.insert(seq->tokens.end(), tokens, tokens + num_tokens);
  return copied;
}

// Stores tokens at positions start.. of the sequence's blocks, allocating a block at each block
// boundary. The blocks must be available and the block list's room reserved.
void BlockManager::write_tokens(Sequence* seq, int64_t start, const int32_t* tokens,
                                int64_t num_tokens) noexcept {
  int64_t pos = start;
  const int64_t end = start + num_tokens;
  while (pos < end) {
    int64_t offset = offset_in_block(pos);
    if (offset == 0) seq->blocks.push_back(allocate_block());
    int64_t run = std::min<int64_t>(block_size_ - offset, end - pos);
    std::memcpy(&block_tokens_[static_cast<size_t>(seq->blocks.back()) * block_size_ + offset],
                tokens + (pos - start), sizeof(int32_t) * run);
    pos += run;
  }
}

void BlockManager::fork(int64_t parent_id, int64_t child_id) {
  const Sequence& parent = sequence(parent_id);
  if (seqs_.count(child_id)) throw DuplicateSequenceError(seq_name(child_id) + " already exists");
  Sequence child = parent;
  Sequence& stored = seqs_.emplace(child_id, std::move(child)).first->second;
  for (int32_t block : stored.blocks) pool_.incref(block);
}

void BlockManager::truncate(int64_t seq_id, int64_t num_tokens) {
  Sequence& seq = get(seq_id);
  int64_t len = static_cast<int64_t>(seq.tokens.size());
  if (num_tokens < 0 || num_tokens > len) {
    throw std::invalid_argument("cannot truncate " + seq_name(seq_id) + " of " +
                                std::to_string(len) + " tokens to " + std::to_string(num_tokens));
  }
  int64_t keep = blocks_for(num_tokens);
  // Release the tail last block first so it is evicted before the prefix that leads to it.
  for (int64_t i = static_cast<int64_t>(seq.blocks.size()) - 1; i >= keep; --i) {
    release_block(seq.blocks[i]);
  }
  seq.blocks.resize(keep);
  seq.tokens.resize(num_tokens);
  seq.num_hashed_blocks =
      static_cast<int32_t>(std::min<int64_t>(seq.num_hashed_blocks, block_of(num_tokens)));
}

void BlockManager::free(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end())
    throw UnknownSequenceError("unknown (or already freed) " + seq_name(seq_id));
  const std::vector<int32_t>& blocks = it->second.blocks;
  for (auto block = blocks.rbegin(); block != blocks.rend(); ++block) release_block(*block);
  seqs_.erase(it);
}

bool BlockManager::can_allocate(int64_t num_tokens) const {
  return num_tokens >= 0 && blocks_for(num_tokens) <= pool_.num_available();
}

int32_t BlockManager::block_refcount(int32_t block) const {
  if (block < 0 || block >= pool_.num_blocks()) {
    throw std::out_of_range("block id " + std::to_string(block) + " out of range");
  }
  return pool_.refcount(block);
}

const int32_t* BlockManager::block_tokens(int32_t block) const {
  block_refcount(block);  // range check
  return block_tokens_.data() + static_cast<size_t>(block) * block_size_;
}

}  // namespace pagedinfer
