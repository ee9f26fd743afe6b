# kvbank_compile_options(target): the project's warnings for one target.
function(kvbank_compile_options target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
  if(KVBANK_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()

# kvbank_add_test(NAME name SOURCES ... [LIBS ...] [LABELS ...] [TIMEOUT s])
# One gtest binary registered with ctest under its own name and labels.
function(kvbank_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main Threads::Threads)
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  kvbank_compile_options(${T_NAME})
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT})
  if(T_LABELS)
    set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}")
  endif()
  if("gpu" IN_LIST T_LABELS)
    kvbank_skip_without_device(${T_NAME})
  endif()
endfunction()

# A gpu test on a machine without a device skips every case, saying "no CUDA device"; ctest then
# reports it as skipped, not passed.
function(kvbank_skip_without_device name)
  set_tests_properties(${name} PROPERTIES SKIP_REGULAR_EXPRESSION "no CUDA device")
endfunction()
