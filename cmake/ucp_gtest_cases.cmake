# Included by ctest (TEST_INCLUDE_FILES), never by the build: registers each
# test case of one GoogleTest binary as its own ctest test, so `ctest -j`
# spreads them. Written by ucp_add_test() into <binary>_cases.cmake as
#   set(UCP_CASE_EXE ...) set(UCP_CASE_PREFIX ...) set(UCP_CASE_PROPS ...)
#   include(<this file>)
# UCP_CASE_PROPS is a list of property names and values, where list-valued
# values (ENVIRONMENT) keep their separators escaped as "\;".
# (CMake 3.25's gtest_discover_tests splits such values into several
# arguments, which drops all environment entries but the first.)
if(NOT EXISTS "${UCP_CASE_EXE}")
  add_test("${UCP_CASE_PREFIX}NOT_BUILT" "${UCP_CASE_EXE}")
  return()
endif()
set(_cache "${UCP_CASE_EXE}.cases")
if(NOT EXISTS "${_cache}" OR "${UCP_CASE_EXE}" IS_NEWER_THAN "${_cache}")
  execute_process(COMMAND "${UCP_CASE_EXE}" --gtest_list_tests
    OUTPUT_VARIABLE _listing RESULT_VARIABLE _rc TIMEOUT 120)
  if(NOT _rc EQUAL 0)
    add_test("${UCP_CASE_PREFIX}LISTING_FAILED" "${UCP_CASE_EXE}" --gtest_list_tests)
    return()
  endif()
  string(REPLACE "\n" ";" _lines "${_listing}")
  set(_cases "")
  set(_suite "")
  foreach(_line IN LISTS _lines)
    string(REGEX REPLACE " *#.*$" "" _line "${_line}")
    if(_line MATCHES "^  +([^ ]+)$")
      list(APPEND _cases "${_suite}${CMAKE_MATCH_1}")
    elseif(_line MATCHES "^([^ ].*\\.)$")
      set(_suite "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  file(WRITE "${_cache}" "${_cases}")
endif()
file(READ "${_cache}" _cases)
foreach(_case IN LISTS _cases)
  add_test("${UCP_CASE_PREFIX}${_case}" "${UCP_CASE_EXE}" "--gtest_filter=${_case}")
  set_tests_properties("${UCP_CASE_PREFIX}${_case}" PROPERTIES ${UCP_CASE_PROPS})
endforeach()
