# The C++ client of ckptd for CMake (the libckpt-client-dev package, tools/packages.sh):
#   find_package(ckpt_client CONFIG REQUIRED)
#   target_link_libraries(my_trainer PRIVATE ckpt_client::ckpt_client)
# The header uses absl::StatusOr: Abseil's own CMake package (libabsl-dev) comes with it.
include(CMakeFindDependencyMacro)
find_dependency(absl CONFIG)

# This file is <prefix>/lib/x86_64-linux-gnu/cmake/ckpt_client/ckpt_clientConfig.cmake.
get_filename_component(_ckpt_client_prefix "${CMAKE_CURRENT_LIST_DIR}/../../../.." ABSOLUTE)
if(NOT TARGET ckpt_client::ckpt_client)
  add_library(ckpt_client::ckpt_client SHARED IMPORTED)
  set_target_properties(ckpt_client::ckpt_client PROPERTIES
    IMPORTED_LOCATION "${_ckpt_client_prefix}/lib/x86_64-linux-gnu/libckpt_client.so.0"
    IMPORTED_SONAME "libckpt_client.so.0"
    INTERFACE_INCLUDE_DIRECTORIES "${_ckpt_client_prefix}/include"
    INTERFACE_COMPILE_FEATURES cxx_std_20
    INTERFACE_LINK_LIBRARIES absl::statusor)
endif()
unset(_ckpt_client_prefix)
