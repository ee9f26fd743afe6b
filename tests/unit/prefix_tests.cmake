# Prefix-sharing unit tests: prefix hash, prefix cache, KV events, model-based check.
# Core only, no gRPC. Included from tests/unit/CMakeLists.txt.
find_package(nlohmann_json QUIET)

kvbank_add_test(NAME prefix_hash_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/prefix_hash_test.cc
                LIBS kvbank_core LABELS unit)
target_compile_definitions(prefix_hash_test
                           PRIVATE KVBANK_TEST_DATA_DIR="${PROJECT_SOURCE_DIR}/tests/data")
if(nlohmann_json_FOUND)
  target_link_libraries(prefix_hash_test PRIVATE nlohmann_json::nlohmann_json)
endif()

# The independent Python implementation checks itself against the same vectors.
# Debian's interpreter: python3-xxhash (install-deps.sh) is installed for it.
find_program(KVBANK_PYTHON3 NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(KVBANK_PYTHON3)
  add_test(NAME prefix_hash_python
           COMMAND ${KVBANK_PYTHON3} ${PROJECT_SOURCE_DIR}/tests/data/prefix_hash.py)
  set_tests_properties(prefix_hash_python PROPERTIES LABELS unit TIMEOUT 60)
endif()

kvbank_add_test(NAME prefix_cache_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/prefix_cache_test.cc
                LIBS kvbank_core kvbank_test_memory LABELS unit)
kvbank_memory_variants(prefix_cache_test)
kvbank_add_test(NAME kv_events_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/kv_events_test.cc
                LIBS kvbank_core kvbank_test_memory LABELS unit)
kvbank_memory_variants(kv_events_test)
kvbank_add_test(NAME prefix_model_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/prefix_model_test.cc
                LIBS kvbank_core kvbank_test_memory LABELS unit TIMEOUT 600)
kvbank_memory_variants(prefix_model_test)
