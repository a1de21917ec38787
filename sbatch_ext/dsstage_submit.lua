--[[
dsstage_submit.lua: submit-time checks of --dataset for slurmctld's job_submit/lua (Lua 5.1).

Call it from your site's job_submit.lua:

    package.path = "/etc/slurm/?.lua;" .. package.path
    local dsstage = require("dsstage_submit")
    dsstage.catalog_path = "/etc/slurm/dsstage_catalog.lua"   -- from `dsstage export-catalog`

    function slurm_job_submit(job_desc, part_list, submit_uid)
        local rc, msg = dsstage.check(job_desc, submit_uid)
        if rc ~= slurm.SUCCESS then
            slurm.log_user(msg)
            return rc
        end
        -- ... the site's own checks ...
        return slurm.SUCCESS
    end

check() rejects unknown datasets (with a suggestion), datasets the user's groups may not
use, and malformed or conflicting values; an accepted request is recorded in the job's
admin_comment as "dsstage=NAME[,NAME...]", which users cannot edit and dsstage reads back
from the queue. The catalog is re-read when its file changes, so `dsstage export-catalog`
takes effect without restarting slurmctld.
]]

local M = {}

M.catalog_path = "/etc/slurm/dsstage_catalog.lua"
M.value_max = 1024
M.name_max = 64

local cached, cached_key

local function file_key(path)
	-- Lua 5.1 has no stat(): the file's size and first line (its generation stamp) stand in
	local f = io.open(path, "r")
	if not f then return nil end
	local first = f:read("*l") or ""
	local size = f:seek("end")
	f:close()
	return first .. ":" .. tostring(size)
end

function M.catalog()
	local key = file_key(M.catalog_path)
	if key == nil then
		return nil, "dsstage: the dataset catalog " .. M.catalog_path ..
			" is missing; an admin must run `dsstage export-catalog`"
	end
	if key ~= cached_key then
		local ok, cat = pcall(dofile, M.catalog_path)
		if not ok or type(cat) ~= "table" or type(cat.datasets) ~= "table" then
			return nil, "dsstage: the dataset catalog " .. M.catalog_path ..
				" is damaged; an admin must run `dsstage export-catalog`"
		end
		cached, cached_key = cat, key
	end
	return cached
end

-- The --dataset value from the job's SPANK environment (indexed from 0), or nil.
local function requested(job_desc)
	local env = job_desc.spank_job_env
	if env == nil then return nil end
	local values = {}
	local i = (env[0] ~= nil) and 0 or 1  -- Slurm 22.05 indexes this table from 0
	while env[i] ~= nil do
		local k, v = string.match(env[i], "^([^=]*)=(.*)$")
		if k == "DSSTAGE_DATASETS" or k == "_SLURM_SPANK_OPTION_dsstage_dataset" then
			values[#values + 1] = v
		end
		i = i + 1
	end
	if #values == 0 then return nil end
	for _, v in ipairs(values) do
		if v ~= values[1] then
			return nil, "dsstage: conflicting --dataset values in the job's environment; submit with one --dataset"
		end
	end
	return values[1]
end

local function distance(a, b)
	local prev = {}
	for j = 0, #b do prev[j] = j end
	for i = 1, #a do
		local cur = { [0] = i }
		for j = 1, #b do
			local cost = (a:sub(i, i) == b:sub(j, j)) and 0 or 1
			cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
		end
		prev = cur
	end
	return prev[#b]
end

local function suggest(name, datasets)
	local best, best_d
	for known, _ in pairs(datasets) do
		local d = distance(name, known)
		if (best_d == nil or d < best_d or (d == best_d and known < best)) then
			best, best_d = known, d
		end
	end
	if best ~= nil and best_d <= math.max(2, math.floor(#name / 3)) then
		return " (did you mean '" .. best .. "'?)"
	end
	return ""
end

function M.parse(value)
	if value == nil or string.match(value, "^%s*$") then
		return nil, "dsstage: --dataset is empty: name at least one dataset (see `dsstage ls`)"
	end
	if #value > M.value_max then
		return nil, "dsstage: --dataset value is " .. #value .. " characters long; at most " ..
			M.value_max .. " are accepted"
	end
	local names, seen = {}, {}
	for part in string.gmatch(value .. ",", "([^,]*),") do
		local name = string.match(part, "^%s*(.-)%s*$")
		if name == "" then
			return nil, "dsstage: --dataset=" .. value .. ": empty dataset name"
		end
		if #name > M.name_max or not string.match(name, "^[a-z0-9][a-z0-9._-]*$") then
			return nil, "dsstage: --dataset: dataset name '" .. name .. "' is not allowed: use lower-case " ..
				"letters, digits, '.', '_' and '-', starting with a letter or digit"
		end
		if not seen[name] then
			seen[name] = true
			names[#names + 1] = name
		end
	end
	return names
end

-- The group names of uid, by asking the system (LDAP/sssd included) through id(1).
function M.groups_of(uid)
	local n = tonumber(uid)
	if n == nil then return {} end
	local p = io.popen("id -Gn -- " .. string.format("%d", n) .. " 2>/dev/null")
	if p == nil then return {} end
	local out = p:read("*a") or ""
	p:close()
	local set = {}
	for g in string.gmatch(out, "%S+") do set[g] = true end
	return set
end

-- slurm.SUCCESS, or slurm.ERROR and a one-line message for the user.
function M.check(job_desc, submit_uid)
	local value, err = requested(job_desc)
	if err then return slurm.ERROR, err end
	if value == nil then return slurm.SUCCESS end
	local names, perr = M.parse(value)
	if names == nil then return slurm.ERROR, perr end
	local cat, cerr = M.catalog()
	if cat == nil then return slurm.ERROR, cerr end
	local user_groups
	for _, name in ipairs(names) do
		local ds = cat.datasets[name]
		if ds == nil then
			return slurm.ERROR, "dsstage: unknown dataset '" .. name .. "'" .. suggest(name, cat.datasets) ..
				"; `dsstage ls` lists the catalog"
		end
		if ds.groups ~= nil and tonumber(submit_uid) ~= 0 then
			user_groups = user_groups or M.groups_of(submit_uid)
			local ok = false
			for _, g in ipairs(ds.groups) do
				if user_groups[g] then ok = true end
			end
			if not ok then
				return slurm.ERROR, "dsstage: dataset '" .. name .. "' is restricted to group(s) " ..
					table.concat(ds.groups, ", ") .. "; you are in none of them: ask the dataset's owners for access"
			end
		end
	end
	M.record(job_desc, names)
	return slurm.SUCCESS
end

-- Record the accepted request in admin_comment (users cannot edit it).
function M.record(job_desc, names)
	local tag = "dsstage=" .. table.concat(names, ",")
	local old = job_desc.admin_comment
	if old == nil or old == "" then
		job_desc.admin_comment = tag
	else
		old = string.gsub(old, "%s*dsstage=[^%s]*", "")
		job_desc.admin_comment = (old == "" and tag) or (old .. " " .. tag)
	end
end

return M
