#include <gtest/gtest.h>

#include <string>

#include "pagedinfer/version.h"

TEST(Version, IsSet) { EXPECT_EQ(std::string(pagedinfer::version()), "0.1.0"); }
