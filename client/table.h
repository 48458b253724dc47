// Left-aligned text tables for ckptctl's human output.
#pragma once

#include <string>
#include <vector>

namespace ckpt {

class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  bool empty() const { return rows_.size() <= 1; }  // header only
  std::string Render() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace ckpt
